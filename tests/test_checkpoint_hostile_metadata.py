"""A ``.metadata`` whose CRC-32 the manifest vouches for, but whose content would make a load quietly wrong.

Each edit rewrites ``.metadata`` and its manifest record (so every CRC check
passes): a load must refuse it naming ``.metadata``, never fill a destination
partly or from the wrong bytes, and ``fsdp-ckpt verify`` must refuse it too.
The relabellings (chunks, row blocks, values or names swapped; a dtype changed
in the manifest as well) are caught by the identity the manifest records for
every key (``KeyRecord.identity``).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import checkpoint
from checkpoint.dcp_metadata import write_metadata
from checkpoint.manifest import METADATA_NAME, read_manifest, write_manifest
from checkpoint.safe_unpickle import load_metadata
from checkpoint.tool.cli import main as cli_main

_SAVED = {
    "w": torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8),
    "b": torch.arange(10.0),
    "v": torch.arange(10.0) + 100,
    "n": 7,
    "opt": {"lr": 0.5, "eps": 0.25},
    "extra": {"first": "one", "second": "two"},
}


def _target() -> dict:
    return {
        "w": torch.full((64, 8), -1.0),
        "b": torch.zeros(10),
        "v": torch.zeros(10),
        "n": None,
        "opt": {"lr": None, "eps": None},
        "extra": {"first": None, "second": None},
    }


def _chunk(md, i: int = 0) -> MetadataIndex:
    return MetadataIndex("w", md.state_dict_metadata["w"].chunks[i].offsets)


def a_chunk_dropped(md) -> None:
    md.state_dict_metadata["w"].chunks.pop()


def a_chunk_shrunk(md) -> None:
    chunks = md.state_dict_metadata["w"].chunks
    chunks[0] = ChunkStorageMetadata(offsets=chunks[0].offsets, sizes=torch.Size([1, 8]))


def a_chunk_moved_outside(md) -> None:
    chunks = md.state_dict_metadata["w"].chunks
    last = chunks[-1]
    chunks[-1] = ChunkStorageMetadata(offsets=torch.Size([last.offsets[0] + 1, 0]), sizes=last.sizes)
    md.storage_data[MetadataIndex("w", chunks[-1].offsets)] = md.storage_data.pop(MetadataIndex("w", last.offsets))


def two_chunks_on_one_byte_range(md) -> None:
    md.storage_data[_chunk(md, 1)] = md.storage_data[_chunk(md, 0)]


def a_value_on_a_tensor_chunk(md) -> None:
    md.storage_data[MetadataIndex("n")] = md.storage_data[_chunk(md, 0)]


def a_range_past_the_file_end(md) -> None:
    md.storage_data[_chunk(md)] = dataclasses.replace(md.storage_data[_chunk(md)], offset=1 << 40)


def another_dtype_than_the_manifest(md) -> None:
    w = md.state_dict_metadata["w"]
    w.properties = dataclasses.replace(w.properties, dtype=torch.int32)  # same item size: bytes reinterpreted


def _swap_storage(md, one: MetadataIndex, other: MetadataIndex) -> None:
    md.storage_data[one], md.storage_data[other] = md.storage_data[other], md.storage_data[one]


def two_same_size_chunks_swapped(md) -> None:
    _swap_storage(md, _chunk(md, 0), _chunk(md, 1))


def two_row_blocks_swapped(md) -> None:
    # the first rows are read from where the last ones are stored, and the other way round
    _swap_storage(md, _chunk(md, 0), _chunk(md, -1))


def two_tensors_swapped(md) -> None:
    _swap_storage(md, MetadataIndex("b", torch.Size([0])), MetadataIndex("v", torch.Size([0])))


def two_option_values_swapped(md) -> None:
    _swap_storage(md, MetadataIndex("opt.lr"), MetadataIndex("opt.eps"))


def two_extra_names_swapped(md) -> None:
    paths = md.planner_data
    paths["extra.first"], paths["extra.second"] = paths["extra.second"], paths["extra.first"]


def float32_relabelled_int32_in_the_manifest_too(md) -> None:
    another_dtype_than_the_manifest(md)


_RELABELLINGS = {
    two_same_size_chunks_swapped: "'w'",
    two_row_blocks_swapped: "'w'",
    two_tensors_swapped: "'b'",
    two_option_values_swapped: "'opt.lr'",
    two_extra_names_swapped: "'extra.first'",
    float32_relabelled_int32_in_the_manifest_too: "'w'",
}


def _tampered(good: Path, root: Path, edit) -> Path:
    """A copy of ``good`` with ``edit`` applied to its ``.metadata``, every CRC-32 recomputed to match."""
    ck = root / "ck"
    shutil.copytree(good, ck)
    metadata = load_metadata(ck / METADATA_NAME, (ck / METADATA_NAME).read_bytes())
    edit(metadata)
    manifest = read_manifest(ck)
    manifest.files[METADATA_NAME] = write_metadata(ck, metadata)  # the manifest vouches for the new bytes
    if edit is float32_relabelled_int32_in_the_manifest_too:
        manifest.keys["w"] = dataclasses.replace(manifest.keys["w"], dtype="int32")
    write_manifest(ck, manifest)
    return ck


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile_metadata") / "good"
    checkpoint.save_state_dict(_SAVED, path, max_chunk_bytes=512)  # several chunks of w
    return path


_EDITS = [
    a_chunk_dropped,
    a_chunk_shrunk,
    a_chunk_moved_outside,
    two_chunks_on_one_byte_range,
    a_value_on_a_tensor_chunk,
    a_range_past_the_file_end,
    another_dtype_than_the_manifest,
    *_RELABELLINGS,
]


@pytest.mark.parametrize("edit", _EDITS)
@pytest.mark.parametrize("verify", ["crc", "full"])
def test_a_crc_valid_metadata_that_misdescribes_the_data_is_refused(good, tmp_path, edit, verify):
    ck = _tampered(good, tmp_path, edit)
    with pytest.raises(
        checkpoint.CheckpointCorruptError, match=r"\.metadata: does not describe a whole checkpoint"
    ) as e:
        checkpoint.load_state_dict(_target(), ck, verify=verify, no_dist=True)
    if edit in _RELABELLINGS:
        assert f"{_RELABELLINGS[edit]} is not stored as manifest.json recorded it" in str(e.value)


@pytest.mark.parametrize("edit", _EDITS)
def test_verify_refuses_every_crc_valid_metadata_a_load_refuses(good, tmp_path, capsys, edit):
    ck = _tampered(good, tmp_path, edit)
    assert cli_main(["verify", str(ck)]) != 0
    out = capsys.readouterr()
    assert "OK" not in out.out, out.out
    if edit in _RELABELLINGS:
        assert f"{_RELABELLINGS[edit]} is not stored as manifest.json recorded it" in out.out + out.err


def test_the_unedited_checkpoint_loads_exactly_and_verifies(good, capsys):
    target = _target()
    checkpoint.load_state_dict(target, good, no_dist=True)
    assert torch.equal(target["w"], _SAVED["w"]) and torch.equal(target["b"], _SAVED["b"])
    assert torch.equal(target["v"], _SAVED["v"]) and target["n"] == 7
    assert target["opt"] == _SAVED["opt"] and target["extra"] == _SAVED["extra"]
    assert cli_main(["verify", str(good)]) == 0
    assert capsys.readouterr().out.startswith("OK")


@pytest.mark.parametrize("kind", ["fifo", "directory", "dangling link"])
def test_a_manifest_that_is_not_a_regular_file_fails_verify_and_load_naming_it(good, tmp_path, capsys, kind):
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    manifest = ck / "manifest.json"
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "directory":
        manifest.mkdir()
    else:
        manifest.symlink_to(tmp_path / "nowhere")
    # Not a plain DCP directory to be verified without file checks: what sits at manifest.json is named.
    assert cli_main(["verify", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "manifest.json" in err and "OK" not in err, err
    with pytest.raises((checkpoint.CheckpointCorruptError, checkpoint.NotACheckpointError), match="manifest.json"):
        checkpoint.load_state_dict(_target(), ck, require_manifest=False, no_dist=True)


def _without_identities(good: Path, root: Path, keys) -> Path:
    ck = root / "ck"
    shutil.copytree(good, ck)
    manifest = read_manifest(ck)
    for key in keys(manifest):
        manifest.keys[key] = dataclasses.replace(manifest.keys[key], identity=None)
    write_manifest(ck, manifest)
    return ck


def test_a_manifest_written_before_identities_still_loads_and_verifies(good, tmp_path, capsys):
    ck = _without_identities(good, tmp_path, lambda manifest: list(manifest.keys))
    assert '"identity"' not in (ck / "manifest.json").read_text()
    target = _target()
    checkpoint.load_state_dict(target, ck, no_dist=True)
    assert torch.equal(target["w"], _SAVED["w"]) and target["extra"] == _SAVED["extra"]
    assert cli_main(["verify", str(ck)]) == 0


def test_a_manifest_with_one_identity_stripped_is_refused_naming_the_key(good, tmp_path, capsys):
    ck = _without_identities(good, tmp_path, lambda manifest: ["w"])
    with pytest.raises(checkpoint.CheckpointCorruptError, match="'w' has no identity in manifest.json"):
        checkpoint.load_state_dict(_target(), ck, no_dist=True)
    assert cli_main(["verify", str(ck)]) == 1
    assert "'w' has no identity in manifest.json" in capsys.readouterr().out


def _random_relabelling(rng: random.Random):
    """Swap two random entries of one kind: byte ranges of two pieces, or two keys' nested names."""

    def edit(md) -> None:
        if rng.random() < 0.75:
            one, other = rng.sample(sorted(md.storage_data, key=repr), 2)
            _swap_storage(md, one, other)
        else:
            one, other = rng.sample(sorted(md.planner_data), 2)
            md.planner_data[one], md.planner_data[other] = md.planner_data[other], md.planner_data[one]

    return edit


def test_random_crc_valid_relabellings_fail_load_and_verify_alike(good, tmp_path, capsys):
    rng = random.Random(20261125)
    for case in range(12):
        ck = _tampered(good, tmp_path / f"case{case}", _random_relabelling(rng))
        with pytest.raises(checkpoint.CheckpointCorruptError, match="not stored as manifest.json recorded it"):
            checkpoint.load_state_dict(_target(), ck, no_dist=True)
        assert cli_main(["verify", str(ck), "-q"]) == 1, case
        assert "not stored as manifest.json recorded it" in capsys.readouterr().out


def test_a_manifest_that_does_not_list_metadata_fails_verify_as_it_fails_load(good, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    manifest = read_manifest(ck)
    del manifest.files[METADATA_NAME]
    write_manifest(ck, manifest)
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"manifest\.json does not list \.metadata"):
        checkpoint.load_state_dict(_target(), ck, no_dist=True)
    assert cli_main(["verify", str(ck), "-q"]) == 1
    assert "manifest.json does not list .metadata" in capsys.readouterr().out


def test_verify_without_checksums_still_checks_metadata_as_a_load_without_them_does(good, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    raw = (ck / METADATA_NAME).read_bytes()
    assert raw.count(b"1.0.0") == 1  # DCP's format version: a change of it alone misleads no check but the CRC-32
    (ck / METADATA_NAME).write_bytes(raw.replace(b"1.0.0", b"1.0.1"))
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"\.metadata: CRC-32 does not match"):
        checkpoint.load_state_dict(_target(), ck, verify="sizes", no_dist=True)
    assert cli_main(["verify", str(ck), "-q", "--no-checksums"]) == 1
    assert ".metadata: CRC-32 does not match the manifest" in capsys.readouterr().out
