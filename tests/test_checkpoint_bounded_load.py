"""Bounded host memory on load: ``max_read_bytes`` caps the bytes held at once in the reader's own buffers.

Bytes that cannot be read straight into their destination (another dtype, part of a chunk) go through
host buffers; the load's report counts the most held at once (``peak_read_buffer_bytes``), and a buffer is
held until its streamed CRC-32 is summed. Counted, never timed.
"""

from __future__ import annotations

import pytest
import torch

import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_ROWS, _COLS = 64, 4096  # 1 MiB of fp32 per tensor: its CRC-32 is summed on the helper thread


def _saved(tmp_path, count: int = 8) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(_ROWS, _COLS) for i in range(count)}
    checkpoint.save_state_dict({"model": state}, tmp_path / "ck")
    return state


def test_a_capped_load_into_another_dtype_is_exact_and_never_holds_more_than_the_cap(tmp_path):
    state = _saved(tmp_path)
    chunk = _ROWS * _COLS * 4
    cap = 2 * chunk + chunk // 2  # two chunks' buffers fit, a third must wait for the first's CRC-32
    targets = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
    report = checkpoint.load_state_dict({"model": targets}, tmp_path / "ck", max_read_bytes=cap)
    for key, value in state.items():
        assert torch.equal(targets[key], value.to(torch.bfloat16)), key
    assert chunk <= report.peak_read_buffer_bytes <= cap


def test_a_capped_partial_read_of_each_chunk_is_exact_and_stays_within_the_cap(tmp_path):
    state = _saved(tmp_path)
    cols = slice(1000, 3000)  # a column box: not one contiguous run of any stored chunk
    targets = {
        k: checkpoint.shard(torch.empty(_ROWS, cols.stop - cols.start), (_ROWS, _COLS), offsets=(0, cols.start))
        for k in state
    }
    cap = _ROWS * _COLS * 4 * 3 // 2
    report = checkpoint.load_state_dict({"model": targets}, tmp_path / "ck", max_read_bytes=cap)
    for key, value in state.items():
        assert torch.equal(targets[key].local, value[:, cols]), key
    assert 0 < report.peak_read_buffer_bytes <= cap


def test_an_item_larger_than_the_cap_is_read_alone(tmp_path):
    state = _saved(tmp_path, count=3)
    targets = {k: torch.empty(v.shape, dtype=torch.float64) for k, v in state.items()}
    report = checkpoint.load_state_dict({"model": targets}, tmp_path / "ck", max_read_bytes=1024)
    for key, value in state.items():
        assert torch.equal(targets[key], value.double()), key
    assert report.peak_read_buffer_bytes == _ROWS * _COLS * 4  # one chunk at a time: cap + largest item


@pytest.mark.parametrize("bad", [0, -1, 1.5, "64MB", True])
def test_max_read_bytes_must_be_a_positive_byte_count(tmp_path, bad):
    _saved(tmp_path, count=1)
    with pytest.raises(ValueError, match="max_read_bytes"):
        checkpoint.load_state_dict({"model": {"w0": torch.empty(_ROWS, _COLS)}}, tmp_path / "ck", max_read_bytes=bad)


def test_an_uncapped_load_reports_its_peak_too(tmp_path):
    state = _saved(tmp_path, count=2)
    targets = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
    report = checkpoint.load_state_dict({"model": targets}, tmp_path / "ck", max_read_bytes=None)
    assert report.peak_read_buffer_bytes >= _ROWS * _COLS * 4
    assert not report  # a statistic, not a problem
