"""Where plain ``dcp.load`` / ``dcp.save`` define the behaviour, ours matches it: each test runs plain DCP as the control.

Stateful values loaded in one order on every rank, meta-device values materialised, values that describe their own
shards through DCP's checkpointable protocol, top-level entries assigned back.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

# LocalShardsWrapper: torch's own checkpointable shard container (no public import path), what TorchRec
# puts under a DTensor; the test meets it as users do
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import checkpoint
from tests.distributed import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

COLLECTIVE_TIMEOUT = timedelta(seconds=20)  # a rank waiting on a collective the other never joins fails, not hangs


# --- Stateful values that run collectives -------------------------------------------------------------------


class _Gathers:
    """A Stateful whose state_dict() and load_state_dict() all-gather across ranks (a sharded dataloader)."""

    def __init__(self, group) -> None:
        self.group = group
        self.seen: list[list[int]] = []

    def _gather(self) -> list[int]:
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, torch.arange(2) + 2 * dist.get_rank(), group=self.group)
        return torch.cat(out).tolist()

    def state_dict(self) -> dict:
        self.seen.append(self._gather())
        return {"k": 1}

    def load_state_dict(self, state: dict) -> None:
        self.seen.append(self._gather())


class _Reduces(_Gathers):
    """A Stateful whose state_dict() and load_state_dict() all-reduce across ranks."""

    def _gather(self) -> list[int]:
        total = torch.arange(2) + 2 * dist.get_rank()
        dist.all_reduce(total, group=self.group)
        return total.tolist()


def _stateful_in_rank_order(rank: int, group) -> dict:
    a, b = _Gathers(group), _Reduces(group)
    return {"A": a, "B": b} if rank == 0 else {"B": b, "A": a}  # rank 1 builds its dict the other way round


def _stateful_order_body(rank: int, world_size: int, tmp: str) -> dict:
    group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    saved = _stateful_in_rank_order(rank, group)
    checkpoint.save_state_dict(saved, f"{tmp}/sd")
    loaded = _stateful_in_rank_order(rank, group)
    checkpoint.load_state_dict(loaded, f"{tmp}/sd")
    checkpoint.save(f"{tmp}/api", extra=_stateful_in_rank_order(rank, group))
    extra = _stateful_in_rank_order(rank, group)
    checkpoint.load(f"{tmp}/api", extra=extra)
    return {name: [obj.seen for obj in (d["A"], d["B"])] for name, d in (("sd", loaded), ("api", extra))}


def test_stateful_values_load_in_one_order_on_every_rank_whatever_order_each_rank_built_its_dict(tmp_path):
    # dcp.load calls load_state_dict in sorted key order on every rank; in each rank's own dict order,
    # rank 0 would wait in all_gather and rank 1 in all_reduce, forever
    results = run_ranks(_stateful_order_body, world_size=2, args=(str(tmp_path),), timeout_s=120)
    gathered, reduced = [0, 1, 2, 3], [2, 4]
    for result in results:
        for seen_by_a, seen_by_b in result.values():
            assert all(s == gathered for s in seen_by_a) and all(s == reduced for s in seen_by_b), result
            assert seen_by_a and seen_by_b


# --- meta-device values ---------------------------------------------------------------------------------------


def _meta_body(rank: int, world_size: int, tmp: str) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    rows = torch.arange(15.0).view(5, 3)
    local = rows[:3] if rank == 0 else rows[3:]  # uneven: 3 rows and 2 rows
    saved = {
        "w": torch.arange(4.0),
        "model": {"rows": DTensor.from_local(local, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1))},
    }
    checkpoint.save_state_dict(saved, f"{tmp}/c")

    def on_meta() -> dict:
        meta_rows = torch.empty(local.shape, device="meta")
        dtensor = DTensor.from_local(meta_rows, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1))
        return {"w": torch.empty(4, device="meta"), "model": {"rows": dtensor}}

    ours, control = on_meta(), on_meta()
    checkpoint.load_state_dict(ours, f"{tmp}/c")
    dcp.load(control, checkpoint_id=f"{tmp}/c")  # plain DCP reads our files: the control
    out = {}
    for name, got in (("ours", ours), ("control", control)):
        dt = got["model"]["rows"]
        out[name] = (got["w"], dt.device.type, dt.placements, dt.to_local(), dt.full_tensor())
    return out


def test_meta_device_values_are_materialised_and_filled_as_dcp_load_does(tmp_path):
    for result in run_ranks(_meta_body, world_size=2, args=(str(tmp_path),), timeout_s=120):
        (w, device, placements, local, full), control = result["ours"], result["control"]
        assert torch.equal(w, torch.arange(4.0)) and torch.equal(full, torch.arange(15.0).view(5, 3))
        assert device == control[1] == "cpu" and placements == control[2]
        assert torch.equal(local, control[3]) and torch.equal(w, control[0])


def test_a_model_on_the_meta_device_is_refused_by_load_naming_the_parameter_and_the_fix(tmp_path):
    checkpoint.save(tmp_path / "c", model=torch.nn.Linear(3, 2))
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"model\.weight.*meta device.*to_empty") as raised:
        checkpoint.load(tmp_path / "c", model=model)
    assert not isinstance(raised.value, checkpoint.CheckpointCorruptError)  # the files are intact


class _NoViews(torch.Tensor):
    """A tensor type whose data cannot be viewed in parts: a load target that cannot take a chunk."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.narrow:
            raise RuntimeError("narrow is not supported by _NoViews")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_load_target_that_cannot_take_the_data_is_named_and_the_files_are_not_blamed(tmp_path):
    checkpoint.save_state_dict({"w": torch.arange(4.0)}, tmp_path / "c")
    target = torch.zeros(4).as_subclass(_NoViews)
    with pytest.raises(
        checkpoint.LoadTargetError, match=r"'w': .*narrow is not supported.*files are not at fault"
    ) as raised:
        checkpoint.load_state_dict({"w": target}, tmp_path / "c")
    assert not isinstance(raised.value, checkpoint.CheckpointCorruptError) and "verify" not in str(raised.value)
    back = {"w": torch.zeros(4)}
    checkpoint.load_state_dict(back, tmp_path / "c", verify="full")  # the same files load into a plain tensor
    assert torch.equal(back["w"], torch.arange(4.0))


# --- values that describe their own shards (DCP's checkpointable protocol) ------------------------------------


class _RowBlock(torch.Tensor):
    """Rows ``[start, start + len(local))`` of a global tensor, described only through DCP's checkpointable protocol.

    Like TorchRec's shard types: no torch operation works on it.
    """

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, rows: int):
        self = torch.Tensor._make_wrapper_subclass(cls, (rows, *local.shape[1:]), dtype=local.dtype)
        self.local, self.start = local, start
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not supported by _RowBlock")

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        offsets = torch.Size((self.start, *[0] * (self.local.dim() - 1)))
        return [ChunkStorageMetadata(offsets=offsets, sizes=self.local.shape)]

    def __create_write_items__(self, fqn: str, object) -> list[WriteItem]:
        (chunk,) = self.__create_chunk_list__()
        data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(self.local), size=self.shape)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


def _uneven_rows(rank: int) -> tuple[torch.Tensor, int]:
    rows = torch.arange(15.0).view(5, 3)
    return (rows[:3].clone(), 0) if rank == 0 else (rows[3:].clone(), 3)


def _protocol_state(rank: int, mesh, fill: float | None = None) -> dict:
    local, start = _uneven_rows(rank)
    if fill is not None:
        local = torch.full_like(local, fill)
    wrapped = LocalShardsWrapper([local.clone()], [(start, 0)])
    return {
        "block": _RowBlock(local, start, 5),
        "lsw": DTensor.from_local(wrapped, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1), run_check=False),
    }


def _protocol_body(rank: int, world_size: int, tmp: str) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    checkpoint.save_state_dict(_protocol_state(rank, mesh), f"{tmp}/ours")
    checkpoint.async_save(f"{tmp}/async", extra=_protocol_state(rank, mesh)).result(timeout=60)
    dcp.save(_protocol_state(rank, mesh), checkpoint_id=f"{tmp}/control")  # plain DCP accepts both: the control
    out: dict = {}
    for name in ("ours", "control"):
        whole = {"block": torch.zeros(5, 3), "lsw": torch.zeros(5, 3)}
        checkpoint.load_state_dict(whole, f"{tmp}/{name}", require_manifest=name == "ours")
        out[name] = whole
    whole = {"block": torch.zeros(5, 3), "lsw": torch.zeros(5, 3)}
    checkpoint.load_state_dict({"extra": whole}, f"{tmp}/async")
    out["async"] = whole
    into = _protocol_state(rank, mesh, fill=-1.0)  # loaded in place, through __get_tensor_shard__
    checkpoint.load_state_dict(into, f"{tmp}/ours")
    out["in_place"] = (into["block"].local, into["lsw"].to_local().local_shards()[0], _uneven_rows(rank)[0])
    two = LocalShardsWrapper([torch.zeros(1, 3), torch.zeros(1, 3)], [(0, 0), (2, 0)])
    with pytest.raises(TypeError, match=r"'?two'?: a DTensor with 2 chunks on this rank .*checkpoint\.shard"):
        checkpoint.save_state_dict(
            {"two": DTensor.from_local(two, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1), run_check=False)},
            f"{tmp}/two",
        )
    return out


def test_values_describing_their_own_shards_through_dcps_protocol_save_and_load_as_plain_dcp_does(tmp_path):
    # a tensor type only the protocol describes, and a DTensor over torch's LocalShardsWrapper with uneven shards
    expected = torch.arange(15.0).view(5, 3)
    for result in run_ranks(_protocol_body, world_size=2, args=(str(tmp_path),), timeout_s=120):
        for name in ("ours", "control", "async"):
            assert all(torch.equal(t, expected) for t in result[name].values()), (name, result[name])
        block, lsw, want = result["in_place"]
        assert torch.equal(block, want) and torch.equal(lsw, want)


# --- top-level entries are assigned back --------------------------------------------------------------------


class _Assignments(dict):
    """A state dict that records every assignment to it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.assigned: list[str] = []

    def __setitem__(self, key, value) -> None:
        self.assigned.append(key)
        super().__setitem__(key, value)


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def _top_level() -> _Assignments:
    return _Assignments(w=torch.zeros(3), nested={"x": torch.zeros(2), "s": "old"}, step=0, counter=_Counter())


def test_every_top_level_entry_but_stateful_ones_is_assigned_back_as_dcp_load_does(tmp_path):
    saved = {"w": torch.ones(3), "nested": {"x": torch.ones(2), "s": "new"}, "step": 7, "counter": _Counter()}
    saved["counter"].n = 5
    checkpoint.save_state_dict(saved, tmp_path / "c")
    ours, control = _top_level(), _top_level()
    nested = ours["nested"]
    checkpoint.load_state_dict(ours, tmp_path / "c")
    dcp.load(control, checkpoint_id=tmp_path / "c")
    assert ours.assigned == control.assigned == ["nested", "step", "w"]
    assert ours["nested"] is nested and torch.equal(nested["x"], torch.ones(2))  # filled in place
    assert ours["step"] == control["step"] == 7 and ours["counter"].n == control["counter"].n == 5
    assert torch.equal(ours["w"], control["w"]) and nested["s"] == control["nested"]["s"] == "new"
