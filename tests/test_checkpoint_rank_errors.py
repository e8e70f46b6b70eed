"""A bad input on one rank of 4 makes every rank raise (never a hang), blocking and async saves alike; so does a
damaged file one rank of 3 reads in a load."""

from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
from offload_fsdp.shard_spec import ShardSpec, attach_shard_spec
from tests.distributed import run_ranks

BAD_RANK = 2


def _dtensor_with_a_wrong_local_shape(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    rows = 3 if rank == BAD_RANK else 2  # 8 rows over 4 ranks: 2 each
    local = torch.full((rows, 4), float(rank))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((8, 4)), stride=(4, 1))


def _non_contiguous_flat_shard(rank: int, world_size: int):
    flat = torch.arange(12.0) + 12 * rank
    if rank == BAD_RANK:
        flat = (torch.arange(24.0) + 12 * rank)[::2]  # 12 elements, as planned, but not contiguous
    attach_shard_spec(flat, ShardSpec((world_size * 12,), flat_start=12 * rank))
    return flat


def _megatron_slice_of_the_wrong_length(rank: int, world_size: int):
    flat = torch.arange(12.0) + 12 * rank
    stop = 12 * rank + (5 if rank == BAD_RANK else 12)
    flat.megatron_fsdp_slice = slice(12 * rank, stop)
    flat.orig_param = torch.empty(world_size * 12, device="meta")
    return flat


MAKERS = {
    "dtensor": _dtensor_with_a_wrong_local_shape,
    "flat": _non_contiguous_flat_shard,
    "megatron": _megatron_slice_of_the_wrong_length,
}
CASES = [(bad, how) for bad in MAKERS for how in ("blocking", "async")] + [("flat", "scale")]


def _save(rank: int, world_size: int, path: str, bad: str, how: str) -> dict:
    state = {"w": MAKERS[bad](rank, world_size), "step": 3}
    try:
        if how == "async":
            checkpoint.async_save(path, extra=state).result(timeout=60)
        else:
            checkpoint.save_state_dict(state, path, mode="collective" if how == "blocking" else how)
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": type(exc).__name__, "message": str(exc)}


def _save_onto_user_data(rank: int, world_size: int, path: str) -> dict:
    state = {"w": _non_contiguous_flat_shard(rank, world_size).contiguous(), "step": 3}
    attach_shard_spec(state["w"], ShardSpec((world_size * 12,), flat_start=12 * rank))
    try:
        checkpoint.save_state_dict(state, path)
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001
        return {"raised": type(exc).__name__, "message": str(exc)}


def _body(rank: int, world_size: int, root: str) -> dict:
    outcomes = {}
    for bad, how in CASES:  # one launch for every case: spawning 4 ranks is the slow part
        outcomes[(bad, how)] = _save(rank, world_size, f"{root}/{bad}-{how}", bad, how)
        dist.barrier()  # every rank is out of the save: none is stuck in it
    outcomes["user_data"] = _save_onto_user_data(rank, world_size, f"{root}/user_data")
    dist.barrier()
    return outcomes


def test_a_bad_input_on_one_rank_of_four_raises_on_every_rank(tmp_path):
    (tmp_path / "user_data").mkdir()
    (tmp_path / "user_data" / "notes.txt").write_text("mine")
    results = run_ranks(_body, 4, args=(str(tmp_path),), timeout_s=120)
    # a target that is not a checkpoint: refused by rank 0 before anything is written, raised on every rank
    assert results[0]["user_data"]["raised"] == "FileExistsError", results[0]["user_data"]
    assert all(r["user_data"]["raised"] == "CheckpointSaveError" for r in results[1:]), [
        r["user_data"] for r in results
    ]
    assert [p.name for p in (tmp_path / "user_data").iterdir()] == ["notes.txt"]
    for case in CASES:
        print(case, {rank: r[case]["raised"] for rank, r in enumerate(results)})
        bad_rank = results[BAD_RANK][case]
        assert bad_rank["raised"] == "ValueError" and "w: " in bad_rank["message"], (case, bad_rank)  # names the key
        for rank, result in enumerate(results):
            if rank != BAD_RANK:
                assert result[case]["raised"] == "CheckpointSaveError", (case, rank, result[case])
                assert f"rank {BAD_RANK}" in result[case]["message"] and "ValueError" in result[case]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user_data"]  # no output, no staging, no lock file


def _load_with_one_damaged_file(rank: int, world_size: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from checkpoint.manifest import read_manifest

    mesh = init_device_mesh("cpu", (world_size,))
    saved = {"w": distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [torch.distributed.tensor.Shard(0)])}
    checkpoint.save_state_dict(saved, f"{root}/ck")
    if rank == 0:
        damaged = f"__{BAD_RANK}_0.distcp"  # only BAD_RANK reads its rows from this file
        assert damaged in read_manifest(f"{root}/ck").files
        data_file = Path(root) / "ck" / damaged
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data_file.write_bytes(bytes(raw))
    dist.barrier()
    outcomes = {}
    target = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [torch.distributed.tensor.Shard(0)])}
    try:
        checkpoint.load_state_dict(target, f"{root}/ck")
        outcomes["load"] = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        outcomes["load"] = {"raised": type(exc).__name__, "message": str(exc)}
    dist.barrier()  # every rank is out of the load: none went on alone
    if rank == 0:  # a rank-local load, one rank alone: no communication, so no wait for the others
        report = checkpoint.load_state_dict({"w": torch.zeros(2, 4)}, f"{root}/ck", strict=False, no_dist=True)
        outcomes["rank-local"] = report.describe()
    dist.barrier()
    return outcomes


def test_a_damaged_file_one_rank_of_three_reads_fails_the_load_on_every_rank(tmp_path):
    results = run_ranks(_load_with_one_damaged_file, 3, args=(str(tmp_path),), timeout_s=120)
    print({rank: r["load"]["raised"] for rank, r in enumerate(results)})
    bad = results[BAD_RANK]["load"]
    assert bad["raised"] == "CheckpointCorruptError" and f"__{BAD_RANK}_0.distcp" in bad["message"], bad
    for rank, result in enumerate(results):
        if rank != BAD_RANK:
            assert result["load"]["raised"] == "CheckpointLoadError", (rank, result)
            assert (
                f"rank {BAD_RANK}" in result["load"]["message"]
                and f"__{BAD_RANK}_0.distcp" in result["load"]["message"]
            )
    assert "mis-shaped" in results[0]["rank-local"]


class _Opaque:
    """A value torch.load(weights_only=True) refuses: save checks every value before writing anything."""


class _BrokenLoader:
    """A Stateful whose state_dict() raises (a dataloader that lost its worker)."""

    def state_dict(self) -> dict:
        raise RuntimeError("loader state is gone")

    def load_state_dict(self, state: dict) -> None:
        pass


_BEFORE_ANY_COLLECTIVE = {
    "refused value": (_Opaque, "ValueError", "weights_only"),
    "stateful raises": (_BrokenLoader, "RuntimeError", "loader state is gone"),
}
_HOWS = ("blocking", "scale", "async")


def _save_failing_before_any_collective(rank: int, world_size: int, root: str) -> dict:
    from datetime import timedelta

    # A short timeout: a rank left waiting in a collective fails the test in seconds instead of hanging it.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    outcomes = {}
    for case, (make, _, _) in _BEFORE_ANY_COLLECTIVE.items():
        for how in _HOWS:
            extra = {"step": 3, "loader": make() if rank == BAD_RANK else [1, 2]}
            path = f"{root}/{case}-{how}"
            try:
                if how == "async":
                    checkpoint.async_save(path, extra=extra, process_group=group).result(timeout=60)
                else:
                    checkpoint.save(
                        path, extra=extra, mode="collective" if how == "blocking" else how, process_group=group
                    )
                outcomes[(case, how)] = {"raised": None}
            except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
                outcomes[(case, how)] = {"raised": type(exc).__name__, "message": str(exc)}
            dist.barrier(group=group)  # every rank is out of the save: none is stuck in it
    return outcomes


def test_a_save_failing_on_one_rank_before_any_collective_raises_on_every_rank(tmp_path):
    results = run_ranks(_save_failing_before_any_collective, 4, args=(str(tmp_path),), timeout_s=150)
    for case, (_, error, fragment) in _BEFORE_ANY_COLLECTIVE.items():
        for how in _HOWS:
            print(case, how, {rank: r[(case, how)]["raised"] for rank, r in enumerate(results)})
            bad = results[BAD_RANK][(case, how)]
            assert bad["raised"] == error and fragment in bad["message"], (case, how, bad)
            for rank, result in enumerate(results):
                if rank != BAD_RANK:
                    got = result[(case, how)]
                    assert got["raised"] == "CheckpointSaveError", (case, how, rank, got)
                    assert f"rank {BAD_RANK}" in got["message"] and error in got["message"], (case, how, got)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written: no output, no staging, no lock file
