"""A ``.metadata`` whose CRC-32 the manifest vouches for, but whose content would make a load quietly wrong.

Each edit rewrites ``.metadata`` and its manifest record (so every CRC check
passes): a load must refuse it naming ``.metadata``, never fill a destination
partly or from the wrong bytes.
"""

from __future__ import annotations

import dataclasses
import os
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

_SAVED = {"w": torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8), "b": torch.arange(10.0), "n": 7}


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


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile_metadata") / "good"
    checkpoint.save_state_dict(_SAVED, path, max_chunk_bytes=512)  # several chunks of w
    return path


@pytest.mark.parametrize(
    "edit",
    [
        a_chunk_dropped,
        a_chunk_shrunk,
        a_chunk_moved_outside,
        two_chunks_on_one_byte_range,
        a_value_on_a_tensor_chunk,
        a_range_past_the_file_end,
        another_dtype_than_the_manifest,
    ],
)
@pytest.mark.parametrize("verify", ["crc", "full"])
def test_a_crc_valid_metadata_that_misdescribes_the_data_is_refused(good, tmp_path, edit, verify):
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    metadata = load_metadata(ck / METADATA_NAME, (ck / METADATA_NAME).read_bytes())
    edit(metadata)
    manifest = read_manifest(ck)
    manifest.files[METADATA_NAME] = write_metadata(ck, metadata)  # the manifest vouches for the new bytes
    write_manifest(ck, manifest)
    target = {"w": torch.full((64, 8), -1.0), "b": torch.zeros(10), "n": None}
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"\.metadata: does not describe a whole checkpoint"):
        checkpoint.load_state_dict(target, ck, verify=verify, no_dist=True)


def test_the_unedited_checkpoint_loads_exactly(good):
    target = {"w": torch.full((64, 8), -1.0), "b": torch.zeros(10), "n": None}
    checkpoint.load_state_dict(target, good, no_dist=True)
    assert torch.equal(target["w"], _SAVED["w"]) and torch.equal(target["b"], _SAVED["b"]) and target["n"] == 7


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
    target = {"w": torch.zeros(64, 8), "b": torch.zeros(10), "n": None}
    with pytest.raises((checkpoint.CheckpointCorruptError, checkpoint.NotACheckpointError), match="manifest.json"):
        checkpoint.load_state_dict(target, ck, require_manifest=False, no_dist=True)
