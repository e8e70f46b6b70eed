"""Async saves reuse their host staging buffers: same memory, call-time state, never shared by two saves in flight."""

import gc
import importlib
import threading
import weakref
from pathlib import Path

import pytest
import torch

import checkpoint
import checkpoint.storage
from checkpoint.async_save import async_save_state_dict
from checkpoint.staging_pool import StagingPool
from tests.distributed import run_ranks

# The module, not the checkpoint.async_save function the package exports under the same name.
_async_module = importlib.import_module("checkpoint.async_save")


def _state(shape=(64, 32), n=4) -> dict:
    return {"w": {f"t{i}": torch.full(shape, float(i)) for i in range(n)}, "step": 5}


def _snapshot(state: dict) -> dict:
    return {"w": {k: v.clone() for k, v in state["w"].items()}, "step": state["step"]}


def _assert_loads_as(path, expected: dict) -> None:
    back = {"w": {k: torch.zeros_like(v) for k, v in expected["w"].items()}, "step": None}
    checkpoint.load_state_dict(back, path)
    assert back["step"] == expected["step"]
    for key, value in expected["w"].items():
        assert torch.equal(back["w"][key], value), key


def _mutate(state: dict) -> None:
    for t in state["w"].values():
        t.add_(100.0)  # training goes on right after the call returns
    state["step"] += 1


def _held_bytes() -> int:
    return _async_module._pool.held_bytes


@pytest.fixture
def lent(monkeypatch):
    """Per async save, in order: DCP key -> weak reference to the staging buffer lent for it."""
    saves: list[dict[str, weakref.ref]] = []
    begin, buffer = StagingPool.begin_save, StagingPool.buffer

    def record_begin(self, **kwargs):
        begin(self, **kwargs)
        saves.append({})

    def record_buffer(self, key, like):
        held = buffer(self, key, like)
        saves[-1][key] = weakref.ref(held)
        return held

    monkeypatch.setattr(StagingPool, "begin_save", record_begin)
    monkeypatch.setattr(StagingPool, "buffer", record_buffer)
    checkpoint.release_staging_buffers()  # start from an empty pool whatever ran before
    yield saves
    checkpoint.release_staging_buffers()


@pytest.fixture
def held_writer(monkeypatch):
    """The writer thread blocks before its first tensor until the test sets the returned event."""
    go = threading.Event()
    original = checkpoint.storage.write_tensor

    def held(stream, tensor):
        assert go.wait(60), "the test never released the writer"
        original(stream, tensor)

    monkeypatch.setattr(checkpoint.storage, "write_tensor", held)
    return go


@pytest.fixture
def slow_writer(monkeypatch):
    """Each tensor takes a while to write, so a bounded save copies the tensors the writer has not reached."""
    original = checkpoint.storage.write_tensor

    def slow(stream, tensor):
        threading.Event().wait(0.03)
        original(stream, tensor)

    monkeypatch.setattr(checkpoint.storage, "write_tensor", slow)


def _same_buffers(first: dict[str, weakref.ref], second: dict[str, weakref.ref]) -> list[str]:
    """Keys whose buffer in ``second`` is the very tensor (same object, same memory) of ``first``."""
    same = []
    for key in first.keys() & second.keys():
        a, b = first[key](), second[key]()
        if a is not None and a is b and a.data_ptr() == b.data_ptr():
            same.append(key)
    return sorted(same)


def test_consecutive_snapshot_saves_reuse_the_same_buffers_and_each_keeps_its_call_time_state(tmp_path, lent):
    state = _state()
    expected = []
    for i in range(3):
        expected.append(_snapshot(state))
        future = async_save_state_dict(state, tmp_path / f"c{i}")
        _mutate(state)
        future.result(timeout=60)
    for i, want in enumerate(expected):
        _assert_loads_as(tmp_path / f"c{i}", want)
    keys = sorted(f"w.t{i}" for i in range(4))
    assert sorted(lent[0]) == keys
    assert _same_buffers(lent[0], lent[1]) == keys and _same_buffers(lent[1], lent[2]) == keys
    assert _held_bytes() == 4 * 64 * 32 * 4


def test_a_second_save_waits_for_the_first_to_finish_before_reusing_its_buffers(tmp_path, lent, held_writer):
    state = _state()
    first_expected = _snapshot(state)
    first = async_save_state_dict(state, tmp_path / "a")  # its writer is held
    _mutate(state)
    second_expected = _snapshot(state)
    second: dict = {}
    caller = threading.Thread(target=lambda: second.update(future=async_save_state_dict(state, tmp_path / "b")))
    caller.start()
    caller.join(0.3)
    # Save 1 is still writing from its buffers: save 2 must not have been lent any of them yet.
    assert caller.is_alive() and not first.done() and len(lent) == 1
    held_writer.set()
    caller.join(60)
    assert not caller.is_alive()
    _mutate(state)
    first.result(timeout=60)
    second["future"].result(timeout=60)
    _assert_loads_as(tmp_path / "a", first_expected)
    _assert_loads_as(tmp_path / "b", second_expected)
    assert len(_same_buffers(lent[0], lent[1])) == 4  # reused, once save 1 was done with them


def test_changed_shapes_get_new_buffers_and_the_stale_ones_are_dropped(tmp_path, lent):
    state = _state()
    async_save_state_dict(state, tmp_path / "a").result(timeout=60)
    resharded = _state()
    resharded["w"]["t1"] = torch.full((32, 32), 7.0)  # another shape under the same key
    resharded["w"]["t4"] = torch.full((8,), 9.0)  # a new key; t3 is gone
    del resharded["w"]["t3"]
    expected = _snapshot(resharded)
    future = async_save_state_dict(resharded, tmp_path / "b")
    _mutate(resharded)
    future.result(timeout=60)
    _assert_loads_as(tmp_path / "b", expected)
    assert _same_buffers(lent[0], lent[1]) == ["w.t0", "w.t2"]
    gc.collect()
    assert lent[0]["w.t1"]() is None and lent[0]["w.t3"]() is None  # not kept after the save that did not use them
    assert _held_bytes() == sum(t.numel() * t.element_size() for t in expected["w"].values())


def test_release_staging_buffers_frees_them_even_while_the_caller_keeps_the_future(tmp_path, lent, slow_writer):
    for budget in (None, 1 << 30):
        future = async_save_state_dict(_state(), tmp_path / "a", max_staging_bytes=budget)
        future.result(timeout=60)
        refs = list(lent[-1].values())
        assert refs and _held_bytes() > 0
        checkpoint.release_staging_buffers()
        gc.collect()
        assert _held_bytes() == 0
        assert all(ref() is None for ref in refs), budget  # the future does not pin the copies either


def test_releasing_while_a_save_is_in_flight_keeps_that_save_intact(tmp_path, lent, held_writer):
    state = _state()
    expected = _snapshot(state)
    future = async_save_state_dict(state, tmp_path / "a")
    _mutate(state)
    checkpoint.release_staging_buffers()
    held_writer.set()
    future.result(timeout=60)
    _assert_loads_as(tmp_path / "a", expected)
    gc.collect()
    assert all(ref() is None for ref in lent[0].values())  # freed once the save let go of them


def test_opting_out_stages_into_fresh_buffers_and_keeps_none(tmp_path, lent):
    state = _state()
    async_save_state_dict(state, tmp_path / "a").result(timeout=60)
    assert _held_bytes() > 0
    expected = _snapshot(state)
    future = async_save_state_dict(state, tmp_path / "b", reuse_staging_buffers=False)
    _mutate(state)
    future.result(timeout=60)
    _assert_loads_as(tmp_path / "b", expected)
    assert _same_buffers(lent[0], lent[1]) == [] and _held_bytes() == 0


def test_the_bounded_path_reuses_its_copies_across_saves(tmp_path, lent, slow_writer):
    state = _state(n=6)
    expected = []
    for i in range(2):
        expected.append(_snapshot(state))
        future = async_save_state_dict(state, tmp_path / f"c{i}", max_staging_bytes=1 << 30)
        _mutate(state)
        future.result(timeout=60)
    for i, want in enumerate(expected):
        _assert_loads_as(tmp_path / f"c{i}", want)
    # The caller copies from the end of the write order while the slow writer is on the first tensors.
    assert "w.t5" in lent[0] and "w.t5" in lent[1]
    assert _same_buffers(lent[0], lent[1]) == sorted(lent[0].keys() & lent[1].keys())
    # Only what the last save copied is kept.
    assert _held_bytes() == len(lent[1]) * 64 * 32 * 4


def test_the_training_api_stages_a_model_into_the_same_buffers_twice(tmp_path, lent):
    model = torch.nn.Linear(4, 3)
    for i in range(2):
        expected = model.weight.detach().clone()
        future = checkpoint.async_save(tmp_path / f"m{i}", model=model)
        with torch.no_grad():
            model.weight.add_(1.0)
        future.result(timeout=60)
        other = torch.nn.Linear(4, 3)
        checkpoint.load(tmp_path / f"m{i}", model=other)
        assert torch.equal(other.weight, expected)
    assert _same_buffers(lent[0], lent[1]) == ["model.bias", "model.weight"]


def _two_rank_body(rank: int, world_size: int, root: str) -> dict:
    rows = [3, 2][rank]  # 5 rows on 2 ranks: uneven shards
    start = [0, 3][rank]
    local = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 10 * start
    ptrs: list[dict[str, int]] = []
    buffer = StagingPool.buffer

    def record_buffer(self, key, like):
        held = buffer(self, key, like)
        ptrs[-1][key] = held.data_ptr()
        return held

    StagingPool.buffer = record_buffer  # a spawned process of its own: nothing to restore
    expected = []
    for i in range(2):
        expected.append(local.clone())
        ptrs.append({})
        future = async_save_state_dict({"w": checkpoint.shard(local, (5, 4), offsets=(start, 0))}, Path(root) / f"c{i}")
        local.add_(100.0)
        future.result(timeout=60)
    full = [torch.zeros(5, 4) for _ in range(2)]
    for i in range(2):
        checkpoint.load_state_dict({"w": full[i]}, Path(root) / f"c{i}")
    return {"ptrs": ptrs, "full": full, "expected": expected, "start": start}


@pytest.mark.slow  # one 2-rank launch: ~3 s on an idle machine, ~10 s on a loaded one
def test_two_ranks_with_uneven_shards_reuse_their_buffers_and_save_the_call_time_state(tmp_path):
    results = run_ranks(_two_rank_body, 2, args=(str(tmp_path),))
    for out in results:
        assert out["ptrs"][0] == out["ptrs"][1] and list(out["ptrs"][0]) == ["w"]
        for i in range(2):
            rows = out["expected"][i].shape[0]
            assert torch.equal(out["full"][i][out["start"] : out["start"] + rows], out["expected"][i])


@pytest.mark.cuda
def test_device_tensors_are_staged_into_pinned_buffers_that_are_reused(tmp_path, lent):
    state = {"w": {"t0": torch.full((256, 64), 1.0, device="cuda")}, "step": 5}
    expected = []
    for i in range(2):
        expected.append({"w": {"t0": state["w"]["t0"].cpu()}, "step": state["step"]})
        future = async_save_state_dict(state, tmp_path / f"c{i}")
        state["w"]["t0"].add_(1.0)
        state["step"] += 1
        future.result(timeout=60)
    for i, want in enumerate(expected):
        _assert_loads_as(tmp_path / f"c{i}", want)
    assert _same_buffers(lent[0], lent[1]) == ["w.t0"]
    assert lent[1]["w.t0"]().is_pinned()


def test_bounded_async_staging_waits_for_every_accelerator_its_shards_live_on(monkeypatch):
    """Not only CUDA: the device of each shard is synchronised through torch.accelerator (meta stands in for one)."""
    from checkpoint.async_save import _synchronize_devices
    from checkpoint.shard import CheckpointShard
    from offload_fsdp.shard_spec import ShardSpec

    synced = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: synced.append(device))
    spec = ShardSpec((2,), offsets=(0,))
    converted = {"a": CheckpointShard(torch.empty(2, device="meta"), spec), "b": CheckpointShard(torch.zeros(2), spec)}
    _synchronize_devices(converted)
    assert synced == [torch.device("meta")]
