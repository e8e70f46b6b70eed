"""The one hand-built DCP Metadata (checkpoint/dcp_metadata.py) and the one .metadata writer."""

from __future__ import annotations

import pickle
import zlib

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from checkpoint.data_file import StorageInfo
from checkpoint.dcp_metadata import MetadataBuilder, write_metadata
from checkpoint.manifest import METADATA_NAME


def _two_ranks() -> MetadataBuilder:
    builder = MetadataBuilder()
    for rank, rows in ((0, (0, 2)), (1, (2, 4))):
        builder.tensor("w", torch.bfloat16, (4, 3), source=f"rank {rank}")
        builder.chunk("w", (rows[0], 0), (2, 3), StorageInfo(f"__{rank}_0.distcp", 0, 100))
        builder.chunk("w", (0, 0), (2, 3), StorageInfo(f"__{rank}_0.distcp", 100, 100))  # a replica of rank 0's
    builder.byte_value("step", StorageInfo("__0_0.distcp", 200, 7))
    builder.path("step", ("extra", "step"))
    return builder


def test_a_replicated_chunk_is_kept_once_where_the_first_writer_stored_it():
    metadata = _two_ranks().build()
    w = metadata.state_dict_metadata["w"]
    assert [tuple(c.offsets) for c in w.chunks] == [(0, 0), (2, 0)]
    assert metadata.storage_data[MetadataIndex("w", torch.Size((0, 0)))] == StorageInfo("__0_0.distcp", 0, 100)
    assert isinstance(metadata.state_dict_metadata["step"], BytesStorageMetadata)
    assert metadata.planner_data == {"step": ("extra", "step")} and metadata.storage_meta is None


@pytest.mark.parametrize(
    ("dtype", "size", "message"),
    [
        (torch.bfloat16, (5, 3), r"ranks disagree on key 'w': rank 2 has shape \(5, 3\)"),
        (torch.float32, (4, 3), r"ranks disagree on the dtype of 'w': rank 2 has float32"),
    ],
)
def test_ranks_that_disagree_on_a_tensor_are_refused_naming_the_key_and_the_rank(dtype, size, message):
    builder = _two_ranks()
    with pytest.raises(ValueError, match=message):
        builder.tensor("w", dtype, size, source="rank 2")


def test_a_chunk_whose_storage_never_arrived_is_an_internal_error_not_a_checkpoint():
    builder = MetadataBuilder()
    builder.tensor("w", torch.float32, (2,))
    builder.chunk("w", (0,), (2,))  # written by another process, whose storage records were not merged
    with pytest.raises(AssertionError, match="no storage location"):
        builder.build()
    builder.storage({MetadataIndex("w", torch.Size((0,))): StorageInfo("__1_0.distcp", 0, 8)})
    assert builder.build().storage_data[MetadataIndex("w", torch.Size((0,)))].relative_path == "__1_0.distcp"


def test_write_metadata_returns_the_size_and_crc_of_the_bytes_it_left_on_disk(tmp_path):
    metadata = _two_ranks().build()
    record = write_metadata(tmp_path, metadata)
    data = (tmp_path / METADATA_NAME).read_bytes()
    assert (record.size, record.crc32) == (len(data), zlib.crc32(data))
    assert pickle.loads(data).state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == [METADATA_NAME]  # no temp file left


def test_storage_problems_allow_values_sharing_one_range_and_name_every_other_shared_or_overrun_range():
    from torch.distributed.checkpoint.metadata import Metadata

    from checkpoint.manifest import FileRecord
    from checkpoint.opener import storage_problems

    def problems(ranges: dict[MetadataIndex, tuple[int, int]]) -> list[str]:
        storage = {index: StorageInfo("f", offset, length) for index, (offset, length) in ranges.items()}
        return storage_problems(Metadata({}, storage_data=storage), {"f": FileRecord(size=100, crc32=0)})

    value = {MetadataIndex(f"g.p{i}.lr"): (10, 5) for i in range(3)}  # one option value, keyed per param
    chunk = MetadataIndex("w", (0,))
    assert problems({**value, chunk: (15, 20)}) == []
    same_range = problems({**value, chunk: (10, 5)})
    assert len(same_range) == 1 and "'w' chunk [0]" in same_range[0] and "share bytes of f" in same_range[0]
    overlap = problems({**value, chunk: (12, 20)})
    assert len(overlap) == 1 and "'w' chunk [0]" in overlap[0]
    past_end = problems({**value, chunk: (90, 20)})
    assert past_end == ["'w' chunk [0] is stored past the end of f (byte 110)"]
