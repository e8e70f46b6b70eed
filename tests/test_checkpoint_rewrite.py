"""The tensor-major writer behind reshard / import (checkpoint/rewrite.py), called in-process.

The reference is the dict of full tensors handed to the writer; plain
``torch.distributed.checkpoint`` reads the result back.
"""

import math
import pickle
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint.atomic import staging_path
from checkpoint.chunk_archive import archive_layout
from checkpoint.manifest import METADATA_NAME, read_manifest, verify_files
from checkpoint.state_dict_io import load_state_dict
from checkpoint.storage_backend import CrcStream
from checkpoint.tool.rewrite import write_checkpoint
from checkpoint.tool.transforms import Target

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _reference() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model.wide": torch.randn(5, 12, generator=g),  # a row is 48 B
        "model.cube": torch.randn(3, 2, 5, generator=g).bfloat16(),  # a row is 20 B
        "model.scalar": torch.tensor(2.5),
        "extra.step": 11,
    }


def _targets(ref: dict) -> list[Target]:
    out = []
    for name, value in ref.items():
        if isinstance(value, torch.Tensor):
            out.append(Target(name, "tensor", value.dtype, tuple(value.shape), (name,)))
        else:
            out.append(Target(name, "object", None, (), (name,)))
    return out


def _write(dst, ref: dict, world_size: int, max_chunk_bytes: int) -> None:
    targets = _targets(ref)
    write_checkpoint(dst, world_size, targets, [(t, ref[t.name]) for t in targets], max_chunk_bytes=max_chunk_bytes)


def _assert_reads_back(path, ref: dict) -> None:
    """Plain DCP, single process, reads back every key of ``ref`` exactly."""
    back = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in ref.items()}
    dcp.load(back, checkpoint_id=str(path), no_dist=True)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key], value), key
        else:
            assert back[key] == value, key


def test_a_failure_while_writing_metadata_leaves_no_output_and_no_staging(tmp_path, monkeypatch):
    ref = _reference()

    class TornStream(CrcStream):  # the .metadata writer's stream: half its bytes land, then the disk is full
        def write(self, b) -> int:
            super().write(memoryview(b)[: len(b) // 2])
            raise OSError("disk full")

    monkeypatch.setattr("checkpoint.dcp_metadata.CrcStream", TornStream)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path / "out", ref, world_size=2, max_chunk_bytes=1 << 20)
    assert not staging_path(tmp_path / "out").exists()
    assert not (tmp_path / "out").exists()


def _stored_chunks(path):
    """(key, offsets, sizes, stored bytes) of every tensor chunk of a checkpoint."""
    metadata = pickle.loads((path / METADATA_NAME).read_bytes())
    for index, info in metadata.storage_data.items():
        if index.offset is None:
            continue
        item = metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in item.chunks if c.offsets == index.offset)
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            yield index.fqn, tuple(chunk.offsets), tuple(chunk.sizes), f.read(info.length)


def _chunk_of(tensor: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (o, s) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, o, s)
    return tensor.contiguous()


def test_rewrite_stores_every_chunk_as_the_raw_bytes_archive_the_save_path_writes(tmp_path):
    ref = _reference()
    _write(tmp_path / "out", ref, world_size=2, max_chunk_bytes=40)
    chunks = list(_stored_chunks(tmp_path / "out"))
    assert len(chunks) > len([v for v in ref.values() if isinstance(v, torch.Tensor)])  # some tensors were cut
    for key, offsets, sizes, stored in chunks:
        piece = _chunk_of(ref[key], offsets, sizes)
        layout = archive_layout(piece.dtype, tuple(piece.shape))
        data = piece.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert stored == layout.head + data + layout.tail(zlib.crc32(data)), key
    _assert_reads_back(tmp_path / "out", ref)
    manifest = read_manifest(tmp_path / "out")
    assert verify_files(tmp_path / "out", manifest) == []  # sizes and CRC-32s kept while writing match the files


@pytest.mark.parametrize("world_size,cap", [(1, 20), (4, 8)], ids=["1-rank-20B", "4-ranks-8B"])
def test_a_chunk_cap_below_one_row_cuts_rows_and_still_reads_back_exactly(tmp_path, world_size, cap):
    ref = _reference()  # rows of 48 B and 20 B; at 4 ranks the 3-row tensor leaves rank 3 empty
    _write(tmp_path / "out", ref, world_size=world_size, max_chunk_bytes=cap)
    covered = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in ref.items() if isinstance(v, torch.Tensor)}
    for key, offsets, sizes, _ in _stored_chunks(tmp_path / "out"):
        assert math.prod(sizes) * ref[key].element_size() <= cap, (key, sizes)
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        covered[key][index] += 1
    for key, counts in covered.items():
        assert torch.equal(counts, torch.ones_like(counts)), key  # every element in exactly one chunk
    _assert_reads_back(tmp_path / "out", ref)
    direct = {k: torch.zeros_like(v) for k, v in ref.items() if isinstance(v, torch.Tensor)}
    load_state_dict(direct, tmp_path / "out", strict=False)  # the format's own reader, not only plain DCP
    for key, value in direct.items():
        assert torch.equal(value, ref[key]), key


def test_a_chunk_cap_below_one_element_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"max chunk size 2 B is smaller than one element \(4 B\)"):
        _write(tmp_path / "out", _reference(), world_size=2, max_chunk_bytes=2)
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()
