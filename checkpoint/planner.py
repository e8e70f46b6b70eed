"""Save planner and metadata checks for the ``fsdp_dtensor`` format.

The save planner is DCP's default one (flattening nested dicts into dotted
keys, de-duplicating replicas across ranks) plus one more check on the global
plan: every tensor's chunks must cover it exactly, so a checkpoint can never
be committed with a hole in it. Chunk metadata itself comes from
:class:`~checkpoint.shard.CheckpointShard`, computed on each rank.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from operator import mul

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["FsdpSavePlanner", "chunk_problem", "metadata_problems"]


class FsdpSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing a global plan that leaves part of a tensor unwritten.

    ``convert(state_dict)``, if given, turns the caller's state dict into
    :class:`~checkpoint.shard.CheckpointShard` leaves inside DCP's local-plan
    step, where DCP gathers every rank's error: a rank whose state cannot be
    converted makes every rank raise, instead of leaving the others waiting.
    """

    def __init__(self, *, validate_cover: bool = True, convert: Callable[[dict], dict] | None = None) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False)
        self.validate_cover = validate_cover
        self.convert = convert

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        if self.convert is not None:
            state_dict = self.convert(state_dict)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        if self.validate_cover:
            problems = metadata_problems(metadata, overlap=False)
            if problems:
                raise ValueError("checkpoint would be incomplete: " + "; ".join(problems[:5]))
        return plans, metadata


def metadata_problems(metadata: Metadata, *, overlap: bool = True) -> list[str]:
    """Every tensor whose chunks leave its bounds or, with ``overlap``, do not cover it exactly once.

    One sentence per bad tensor, naming its key. Without ``overlap`` only the
    chunks' total volume is compared with the tensor's (what the save planner asks for).
    """
    problems = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        problem = chunk_problem(key, tuple(md.size), [(c.offsets, c.sizes) for c in md.chunks], overlap=overlap)
        if problem is not None:
            problems.append(problem)
    return problems


def chunk_problem(
    key: str, shape: tuple[int, ...], chunks: list[tuple[Sequence[int], Sequence[int]]], *, overlap: bool = True
) -> str | None:
    """What is wrong with ``chunks`` (``(offsets, sizes)`` each) as a cover of a tensor of ``shape``, or ``None``.

    Linear in the number of chunks (times ``2**ndim``), whatever their layout.
    """
    volume = 0
    for offsets, sizes in chunks:
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape))
        ):
            return f"{key}: chunk at {list(offsets)} of size {list(sizes)} leaves shape {list(shape)}"
        volume += math.prod(sizes)
    numel = math.prod(shape)
    if overlap:
        element = _first_miscovered(shape, chunks)
        if element is not None:
            return _miscover_sentence(key, shape, chunks, element, volume)
    if volume > numel:
        return (
            f"{key}: chunks hold {volume} elements, more than its {numel} (shape {list(shape)}); some are stored twice"
        )
    if volume < numel:
        return f"{key}: chunks hold {volume} of its {numel} elements (shape {list(shape)}); a rank's part is missing"
    return None


def _first_miscovered(shape: tuple[int, ...], chunks) -> tuple[int, ...] | None:
    """The first element (row-major) not covered exactly once, or ``None``. Precondition: chunks inside ``shape``.

    Each box counts ``+1`` or ``-1`` at each of its ``2**ndim`` corners (the
    sign flips with every upper bound the corner takes), the tensor's own box
    with the opposite signs. These signed corner counts are the discrete mixed
    difference of the coverage count, which they determine completely: they
    all cancel exactly when every element is covered once. Where they do not,
    the row-major smallest corner left over has no other one at or below it in
    every dim, so the coverage there is off by its count.
    """
    # a corner (a point of the (size + 1)-grid) as one int, row-major: min() is the row-major first
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * (shape[d + 1] + 1)
    plus: list[int] = []
    minus: list[int] = []
    for offsets, sizes in chunks:
        if math.prod(sizes):  # an empty box's corners cancel anyway
            even, odd = _corners(offsets, sizes, strides)
            plus += even
            minus += odd
    if math.prod(shape):
        even, odd = _corners((0,) * len(shape), shape, strides)
        plus += odd
        minus += even
    plus_count, minus_count = Counter(plus), Counter(minus)  # counted in C: this is the hot loop at scale
    if plus_count.items() == minus_count.items():  # (Counter's own == loops in Python)
        return None
    flat = min(k for k in plus_count.keys() | minus_count.keys() if plus_count[k] != minus_count[k])
    element = []
    for stride in strides:
        i, flat = divmod(flat, stride)
        element.append(i)
    return tuple(element)


def _corners(offsets, sizes, strides) -> tuple[list[int], list[int]]:
    """A box's corners as grid ints: those with an even, and those with an odd number of upper bounds."""
    even: list[int] = [sum(map(mul, offsets, strides))]
    odd: list[int] = []
    for size, stride in zip(sizes, strides):
        step = size * stride
        even, odd = even + [k + step for k in odd], odd + [k + step for k in even]
    return even, odd


def _miscover_sentence(key, shape, chunks, element, volume) -> str:
    holders = [list(o) for o, s in chunks if all(a <= e < a + n for a, n, e in zip(o, s, element))]
    assert len(holders) != 1, f"{key}: element {element} flagged but covered once"
    if holders:
        return f"{key}: chunks at {holders[0]} and {holders[1]} overlap (element {list(element)} is stored {len(holders)} times)"
    return (
        f"{key}: chunks hold {volume} of its {math.prod(shape)} elements (shape {list(shape)}) and element "
        f"{list(element)} is in none; a rank's part is missing"
    )
