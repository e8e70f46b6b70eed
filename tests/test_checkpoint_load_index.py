"""The manifest's load index: a load of a checkpoint whose keys are each one piece reads no ``.metadata`` pickle.

The index is trusted only when it checks out (its CRC-32 over the columns and key records, the pin to the
``.metadata`` it was made from, every piece inside a listed file and no two sharing bytes); anything else and
the load unpickles ``.metadata`` and compares it as before: an exact result or the same clear error.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint
import checkpoint.opener
from checkpoint.dcp_metadata import write_metadata
from checkpoint.manifest import METADATA_NAME, read_manifest, write_manifest
from checkpoint.safe_unpickle import load_metadata
from checkpoint.tool.cli import main as cli_main
from tests.test_checkpoint_hostile_metadata import (
    _SAVED,
    a_range_past_the_file_end,
    a_shared_value_pointed_at_another_value,
    a_shared_value_renested,
    a_value_on_a_tensor_chunk,
    another_dtype_than_the_manifest,
    the_source_of_a_shared_value_moved_with_it,
    two_extra_names_swapped,
    two_option_values_swapped,
    two_tensors_swapped,
)
from tests.test_checkpoint_hostile_metadata import _target as _empty_target


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Path:
    """``_SAVED`` (tensors, values, a shared value, nested extras) plus a key whose nested path is not its
    dotted name: every key one piece, so the manifest holds a load index."""
    path = tmp_path_factory.mktemp("load_index") / "ck"
    checkpoint.save_state_dict({**_SAVED, "dotted": {"a.b": torch.arange(3.0)}}, path)
    assert "load_index" in json.loads((path / "manifest.json").read_text())
    return path


def _target() -> dict:
    return {**_empty_target(), "dotted": {"a.b": torch.zeros(3)}}


def _assert_loads_exactly_through_metadata(ck, unpickles: list) -> None:
    """``ck`` loads exactly, having unpickled ``.metadata`` once (its index was not trusted)."""
    target = _target()
    checkpoint.load_state_dict(target, ck, no_dist=True)
    _assert_exact(target)
    assert unpickles == [1]


def _assert_exact(target: dict) -> None:
    for key in ("w", "b", "v"):
        assert torch.equal(target[key], _SAVED[key]), key
    assert torch.equal(target["dotted"]["a.b"], torch.arange(3.0))
    assert {k: target[k] for k in ("n", "opt", "extra", "groups")} == {
        k: _SAVED[k] for k in ("n", "opt", "extra", "groups")
    }


@pytest.fixture
def unpickles(monkeypatch) -> list[int]:
    """Counts the opener's unpickling of ``.metadata`` (each call appends 1)."""
    calls: list[int] = []
    real = checkpoint.opener.load_metadata

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(checkpoint.opener, "load_metadata", counted)
    return calls


def test_a_checkpoint_with_a_load_index_loads_exactly_without_unpickling_metadata(indexed, monkeypatch):
    def refuse(*args):
        raise AssertionError(".metadata was unpickled")

    monkeypatch.setattr(checkpoint.opener, "load_metadata", refuse)
    target = _target()
    checkpoint.load_state_dict(target, indexed, no_dist=True)
    _assert_exact(target)


def test_a_model_and_optimizer_load_through_the_index_exactly_without_unpickling(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.2}]
    )
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, extra={"step": 7, "a.b": {"c": [1, 2]}})
    monkeypatch.setattr(checkpoint.opener, "load_metadata", lambda *a: pytest.fail(".metadata was unpickled"))
    other = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    other_opt = torch.optim.AdamW(
        [{"params": other[0].parameters(), "lr": 0.5}, {"params": other[1].parameters(), "lr": 0.5}]
    )
    extra = checkpoint.load(tmp_path / "ck", model=other, optimizer=other_opt)
    assert extra == {"step": 7, "a.b": {"c": [1, 2]}}
    for mine, theirs in zip(model.parameters(), other.parameters()):
        assert torch.equal(mine, theirs)
    assert repr(other_opt.state_dict()) == repr(opt.state_dict())


def _edited_manifest(src: Path, root: Path, edit) -> Path:
    """A copy of ``src`` whose ``manifest.json`` text is ``edit(text)``."""
    ck = root / "edited"
    shutil.copytree(src, ck)
    text = (ck / "manifest.json").read_text()
    edited = edit(text)
    assert edited != text
    (ck / "manifest.json").write_text(edited)
    return ck


def _flip_in_column(column: str, nth: int):
    """Change the last digit of the ``nth`` number of the index's ``column`` (another valid number)."""

    def edit(text: str) -> str:
        line = next(line for line in text.splitlines() if line.strip().startswith(f'"{column}": '))
        numbers = list(re.finditer(r"\d+", line[line.index(":") :]))
        m = numbers[nth % len(numbers)]
        start = line.index(":") + m.end() - 1
        digit = line[start]
        flipped = line[:start] + str((int(digit) + 1) % 10) + line[start + 1 :]
        return text.replace(line, flipped)

    return edit


@pytest.mark.parametrize(
    "edit",
    [
        _flip_in_column("offset", 0),
        _flip_in_column("offset", 3),
        _flip_in_column("length", 1),
        _flip_in_column("file", 2),
        _flip_in_column("crc32", 0),
    ],
    ids=["offset-0", "offset-3", "length-1", "file-2", "crc32"],
)
def test_a_flipped_digit_in_the_index_falls_back_to_metadata_and_loads_exactly(indexed, tmp_path, unpickles, edit):
    ck = _edited_manifest(indexed, tmp_path, edit)
    _assert_loads_exactly_through_metadata(ck, unpickles)


def test_a_key_record_edited_under_the_index_falls_back_and_loads_exactly(indexed, tmp_path, unpickles):
    """A dtype changed in the manifest alone (same item size): read through the index, ``b``'s bytes would be
    reinterpreted; its CRC-32 covers the records, so the load reads ``.metadata`` instead."""
    manifest = read_manifest(indexed)
    ck = tmp_path / "ck"
    shutil.copytree(indexed, ck)
    write_manifest(
        ck,
        dataclasses.replace(
            manifest, keys={**manifest.keys, "b": dataclasses.replace(manifest.keys["b"], dtype="int32")}
        ),
    )
    _assert_loads_exactly_through_metadata(ck, unpickles)


def test_a_pin_that_does_not_match_metadata_falls_back_and_loads_exactly(indexed, tmp_path, unpickles):
    manifest = read_manifest(indexed)
    ck = tmp_path / "ck"
    shutil.copytree(indexed, ck)
    pin = manifest.keys_from_metadata_crc32
    assert pin is not None
    write_manifest(ck, dataclasses.replace(manifest, keys_from_metadata_crc32=pin ^ 1))
    _assert_loads_exactly_through_metadata(ck, unpickles)


def _index_columns_edited(src: Path, root: Path, edit) -> Path:
    """A copy of ``src`` whose index columns are ``edit``-ed, its CRC-32 recomputed to match (a deliberate edit)."""
    manifest = read_manifest(src)
    index = manifest.load_index
    assert index is not None
    columns = {name: list(getattr(index, name)) for name in ("files", "file", "offset", "length")}
    edit(columns, list(manifest.keys))
    edited = dataclasses.replace(index, **columns)
    edited = dataclasses.replace(edited, crc32=edited.digest(manifest.keys))
    ck = root / "ck"
    shutil.copytree(src, ck)
    write_manifest(ck, dataclasses.replace(manifest, load_index=edited))
    return ck


def _past_the_file_end(columns, keys) -> None:
    columns["offset"][keys.index("w")] += 1 << 30


def _onto_another_piece(columns, keys) -> None:
    columns["offset"][keys.index("w")] = columns["offset"][keys.index("b")]


def _into_metadata(columns, keys) -> None:
    columns["files"].append(METADATA_NAME)
    columns["file"][keys.index("b")] = len(columns["files"]) - 1
    columns["offset"][keys.index("b")] = 0


@pytest.mark.parametrize("edit", [_past_the_file_end, _onto_another_piece, _into_metadata])
def test_an_index_pointing_outside_its_pieces_falls_back_and_loads_exactly(indexed, tmp_path, unpickles, edit):
    ck = _index_columns_edited(indexed, tmp_path, edit)
    _assert_loads_exactly_through_metadata(ck, unpickles)


_REWRITES = {
    two_tensors_swapped: "'b' is not stored as manifest.json recorded it",
    two_option_values_swapped: "'opt.lr' is not stored as manifest.json recorded it",
    two_extra_names_swapped: "'extra.first' is not stored as manifest.json recorded it",
    a_shared_value_pointed_at_another_value: "'groups.b.lr' is not stored as manifest.json recorded it",
    a_shared_value_renested: "'groups.b.lr' is not stored as manifest.json recorded it",
    the_source_of_a_shared_value_moved_with_it: "'groups.a.lr' is not stored as manifest.json recorded it",
    another_dtype_than_the_manifest: "does not describe a whole checkpoint",
    a_range_past_the_file_end: "does not describe a whole checkpoint",
    a_value_on_a_tensor_chunk: "does not describe a whole checkpoint",
}


@pytest.mark.parametrize("edit", list(_REWRITES), ids=lambda f: f.__name__)
def test_a_metadata_rewritten_with_its_crc_recomputed_is_compared_and_refused(indexed, tmp_path, edit):
    """The manifest vouches for the new bytes (its file record), not the pin: the index is not trusted, and
    ``.metadata`` is compared with the key records as without an index."""
    ck = tmp_path / "ck"
    shutil.copytree(indexed, ck)
    metadata = load_metadata(ck / METADATA_NAME, (ck / METADATA_NAME).read_bytes())
    edit(metadata)
    manifest = read_manifest(ck)
    manifest.files[METADATA_NAME] = write_metadata(ck, metadata)
    write_manifest(ck, manifest)
    with pytest.raises(checkpoint.CheckpointCorruptError, match=re.escape(_REWRITES[edit])):
        checkpoint.load_state_dict(_target(), ck, no_dist=True)


def test_verify_reports_an_index_that_disagrees_with_metadata(indexed, tmp_path, capsys):
    ck = _edited_manifest(indexed, tmp_path, _flip_in_column("offset", 0))
    assert cli_main(["verify", str(ck)]) == 1
    assert "load_index" in capsys.readouterr().out
    assert cli_main(["verify", str(indexed)]) == 0


def test_a_sharded_save_writes_no_index_and_loads_as_before(tmp_path, unpickles):
    checkpoint.save_state_dict(_SAVED, tmp_path / "ck", max_chunk_bytes=512)  # several chunks of w
    assert read_manifest(tmp_path / "ck").load_index is None
    target = _empty_target()
    checkpoint.load_state_dict(target, tmp_path / "ck", no_dist=True)
    assert torch.equal(target["w"], _SAVED["w"]) and target["groups"] == _SAVED["groups"]
    assert unpickles == [1]
