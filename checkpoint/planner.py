"""Save planner and metadata checks for the ``fsdp_dtensor`` format.

The save planner is DCP's default one (flattening nested dicts into dotted
keys, de-duplicating replicas across ranks) plus one more check on the global
plan: every tensor's chunks must cover it exactly, so a checkpoint can never
be committed with a hole in it. Chunk metadata itself comes from
:class:`~checkpoint.shard.CheckpointShard`, computed on each rank.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_right, insort

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["FsdpSavePlanner", "metadata_problems"]


class FsdpSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing a global plan that leaves part of a tensor unwritten."""

    def __init__(self, *, validate_cover: bool = True) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False)
        self.validate_cover = validate_cover

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        if self.validate_cover:
            problems = metadata_problems(metadata, overlap=False)
            if problems:
                raise ValueError("checkpoint would be incomplete: " + "; ".join(problems[:5]))
        return plans, metadata


def metadata_problems(metadata: Metadata, *, overlap: bool = True) -> list[str]:
    """Every tensor whose chunks leave its bounds, overlap (if ``overlap``) or do not cover it exactly."""
    problems = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        problems += _tensor_problems(key, md, overlap)
    return problems


def _tensor_problems(key: str, md: TensorStorageMetadata, overlap: bool) -> list[str]:
    size = tuple(md.size)
    volume = 0
    for chunk in md.chunks:
        if any(o < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, size)):
            return [f"{key}: chunk at {tuple(chunk.offsets)} of size {tuple(chunk.sizes)} leaves shape {size}"]
        volume += math.prod(chunk.sizes)
    if overlap and len(md.chunks) > 1 and size:
        hit = _first_overlap(md.chunks, max(range(len(size)), key=lambda d: size[d]))
        if hit is not None:
            return [f"{key}: chunks at {hit[0]} and {hit[1]} overlap"]
    if volume != math.prod(size):
        return [f"{key}: chunks hold {volume} of its {math.prod(size)} elements (shape {size}); a rank's part is missing"]
    return []


def _first_overlap(chunks, dim: int):
    """A sweep along ``dim``: only chunks whose ranges in ``dim`` intersect are compared."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i].offsets[dim])
    active: list[tuple[int, int]] = []  # (end in dim, chunk index), sorted
    for i in order:
        c = chunks[i]
        start = c.offsets[dim]
        del active[: bisect_right(active, (start, sys.maxsize))]
        for _, j in active:
            if _boxes_overlap(c, chunks[j]):
                return tuple(c.offsets), tuple(chunks[j].offsets)
        if math.prod(c.sizes):
            insort(active, (start + c.sizes[dim], i))
    return None


def _boxes_overlap(a, b) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    ) and bool(math.prod(a.sizes))
