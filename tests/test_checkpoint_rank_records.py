"""``commit`` merges only what it can vouch for: rank records of one save, each valid, describing files that load.

A rank record (``__<r>.rank.json``, written by ``write_rank`` or a scale-mode
save) that is damaged, of another save, or inconsistent with the files on disk
is refused with a ``ValueError`` naming the record or the problem, and the
committed checkpoint already at the path stays as it was and loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.atomic import staging_path

_KEPT = torch.full((8, 3), 9.0)


def _part(rank: int, value: float) -> dict:
    return {"w": checkpoint.shard(torch.full((4, 3), value), (8, 3), offsets=(4 * rank, 0))}


def _two_ranks_over_a_committed_checkpoint(path: Path, **kwargs) -> Path:
    """A committed checkpoint at ``path`` (``_KEPT``), then both ranks of a new save written, not committed."""
    checkpoint.save_state_dict({"w": _KEPT}, path)
    for rank in range(2):
        checkpoint.write_rank(path, rank, 2, {**_part(rank, 1.0), "b": torch.arange(3.0)}, **kwargs)
    return staging_path(path) / "__1.rank.json"


def _edit_record(record_path: Path, edit) -> None:
    record = json.loads(record_path.read_text())
    edit(record)
    record_path.write_text(json.dumps(record))


def _assert_kept(path: Path) -> None:
    got = {"w": torch.zeros(8, 3)}
    checkpoint.load_state_dict(got, path, no_dist=True)
    assert torch.equal(got["w"], _KEPT)


def _only_chunk(record: dict) -> list:
    (chunk,) = record["tensors"]["w"]["chunks"]
    return chunk


_BAD_JSON = {
    "truncated": lambda text: text[: len(text) // 2],
    "not JSON": lambda text: "\x00\x01 garbage",
    "not UTF-8": lambda text: "\udcff",
    "a JSON list": lambda text: "[1, 2]",
    "no world size": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "world_size"}),
    "deeply nested": lambda text: "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("damage", _BAD_JSON)
def test_a_rank_record_that_is_not_valid_json_is_named_and_the_checkpoint_kept(tmp_path, damage):
    path = tmp_path / "ck"
    record_path = _two_ranks_over_a_committed_checkpoint(path)
    text = _BAD_JSON[damage](record_path.read_text())
    record_path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=r"__1\.rank\.json is not a valid rank record.*write rank 1 again"):
        checkpoint.commit(path, 2)
    _assert_kept(path)


def _unlisted_file(record: dict) -> None:
    record["files"] = {}


def _wrong_file_size(record: dict) -> None:
    (name,) = record["files"]
    record["files"][name][0] += 1


def _range_past_the_file_end(record: dict) -> None:
    (size, _), chunk = next(iter(record["files"].values())), _only_chunk(record)
    chunk[3] = size


def _two_keys_on_one_byte_range(record: dict) -> None:
    record["bytes"]["n"] = _only_chunk(record)[2:]


def _a_file_that_is_not_there(record: dict) -> None:
    (name,) = record["files"]
    record["files"] = {"__7_0.distcp": record["files"][name]}
    _only_chunk(record)[2] = "__7_0.distcp"


def _a_dtype_torch_does_not_have(record: dict) -> None:
    record["tensors"]["w"]["dtype"] = "Tensor"


def _an_offset_that_is_not_an_integer(record: dict) -> None:
    _only_chunk(record)[3] = 1.5


_INCONSISTENT = [
    _unlisted_file,
    _wrong_file_size,
    _range_past_the_file_end,
    _two_keys_on_one_byte_range,
    _a_file_that_is_not_there,
    _a_dtype_torch_does_not_have,
    _an_offset_that_is_not_an_integer,
]


@pytest.mark.parametrize("edit", _INCONSISTENT)
def test_commit_never_replaces_a_good_checkpoint_by_one_its_rank_records_would_make_unloadable(tmp_path, edit):
    path = tmp_path / "ck"
    record_path = _two_ranks_over_a_committed_checkpoint(path)
    _edit_record(record_path, edit)
    with pytest.raises(ValueError, match=r"cannot commit"):
        checkpoint.commit(path, 2)
    _assert_kept(path)


def test_commit_refuses_a_record_of_an_earlier_unfinished_save_given_a_save_id(tmp_path):
    path = tmp_path / "ck"
    _two_ranks_over_a_committed_checkpoint(path, save_id="step-100")  # never committed
    checkpoint.write_rank(path, 0, 2, _part(0, 2.0), save_id="step-200")  # rank 1 of this save never ran
    with pytest.raises(ValueError, match=r"records of ranks \[1\] were written by another save than 'step-200'"):
        checkpoint.commit(path, 2, save_id="step-200")
    with pytest.raises(ValueError, match=r"records of ranks \[1\] were written by another save"):
        checkpoint.commit(path, 2)  # no id given: the records must still agree with each other
    _assert_kept(path)
    checkpoint.write_rank(path, 1, 2, _part(1, 2.0), save_id="step-200")
    checkpoint.commit(path, 2, save_id="step-200")
    got = {"w": torch.zeros(8, 3)}
    checkpoint.load_state_dict(got, path, no_dist=True)
    assert torch.equal(got["w"], torch.full((8, 3), 2.0))
