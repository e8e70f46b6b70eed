"""Async saves with bounded staging: call-time state, at most the budget in copies, errors surface."""

import time

import pytest
import torch

import checkpoint
import checkpoint.staging
import checkpoint.storage
from checkpoint.async_save import async_save_state_dict


def _state() -> dict:
    return {"w": {f"t{i}": torch.full((64, 32), float(i)) for i in range(6)}, "step": 5}


def _load(path) -> dict:
    back = {"w": {f"t{i}": torch.zeros(64, 32) for i in range(6)}, "step": None}
    checkpoint.load_state_dict(back, path)
    return back


@pytest.fixture
def gates(monkeypatch):
    made = []
    original = checkpoint.staging.StagingGate.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(checkpoint.staging.StagingGate, "__init__", record)
    return made


@pytest.fixture
def slow_writer(monkeypatch):
    """Each tensor takes a while to write, so the caller would return before the writer is done if it did not wait."""
    original = checkpoint.storage.write_tensor

    def slow(stream, tensor):
        time.sleep(0.03)
        original(stream, tensor)

    monkeypatch.setattr(checkpoint.storage, "write_tensor", slow)


@pytest.mark.parametrize("budget", [0, 64 * 32 * 4 * 2, 1 << 30])
def test_bounded_async_save_writes_the_call_time_state_with_at_most_the_budget_in_copies(
    tmp_path, budget, gates, slow_writer
):
    state = _state()
    expected = {k: v.clone() for k, v in state["w"].items()}
    future = async_save_state_dict(state, tmp_path / "c", max_staging_bytes=budget)
    for t in state["w"].values():
        t.add_(100.0)  # training goes on right after the call returns
    state["step"] = 6
    assert future.result(timeout=60) is None
    back = _load(tmp_path / "c")
    assert back["step"] == 5
    for key, value in expected.items():
        assert torch.equal(back["w"][key], value), key
    (gate,) = gates
    assert gate.copied_bytes <= budget
    if budget == 0:
        assert gate.copied_bytes == 0  # host tensors went to the file uncopied
    if budget == 1 << 30:
        assert gate.copied_bytes > 0  # the caller staged what the slow writer had not reached


def test_a_bounded_async_save_that_fails_before_writing_reports_it_and_does_not_hang(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    future = async_save_state_dict(_state(), blocker / "c", max_staging_bytes=0)
    with pytest.raises(NotADirectoryError, match="not a directory"):  # refused before anything was written
        future.result(timeout=60)


def test_async_save_through_the_training_api_accepts_a_staging_budget(tmp_path):
    model = torch.nn.Linear(4, 3)
    expected = model.weight.detach().clone()
    future = checkpoint.async_save(tmp_path / "m", model=model, extra={"step": 1}, max_staging_bytes=0)
    with torch.no_grad():
        model.weight.add_(1.0)
    future.result(timeout=60)
    other = torch.nn.Linear(4, 3)
    assert checkpoint.load(tmp_path / "m", model=other)["step"] == 1
    assert torch.equal(other.weight, expected)
    with pytest.raises(ValueError, match="max_staging_bytes"):
        checkpoint.save(tmp_path / "n", model=model, max_staging_bytes=0)
    with pytest.raises(ValueError, match="reuse_staging_buffers"):
        checkpoint.save(tmp_path / "n", model=model, reuse_staging_buffers=False)
