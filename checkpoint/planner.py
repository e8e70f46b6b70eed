"""Save planner and metadata checks for the ``fsdp_dtensor`` format.

The save planner is DCP's default one (flattening nested dicts into dotted
keys, de-duplicating replicas across ranks) plus one more check on the global
plan: every tensor's chunks must cover it exactly, so a checkpoint can never
be committed with a hole in it. Chunk metadata itself comes from
:class:`~checkpoint.shard.CheckpointShard`, computed on each rank.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from checkpoint.convert import flatten_state_dict

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
        self._pickled: dict[int, bytes] = {}  # id of a byte item's object -> its torch.save bytes, this save

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        if self.convert is not None:
            state_dict = self.convert(state_dict)
        # DCP's keys and planner_data by our flattening, linear where DCP's re-walks a list at each reference
        # (torch's flattened optimizer layout: O(N^2)); DCP then takes the flat dict as it is
        state_dict, mappings = flatten_state_dict(state_dict)
        self._pickled = {}
        self.flatten_state_dict = False
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.flatten_state_dict, self.mappings = True, mappings  # the plans carry the mappings (planner_data)

    def transform_object(self, write_item: WriteItem, object: Any):
        """DCP's ``torch.save`` of a byte item, once per object: torch's flattened optimizer layout
        references a group's ``param_names`` (every name) from each parameter's key, O(N^2) pickled per key."""
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        # the planner's state dict keeps every object alive for the save: an id is not reused meanwhile
        pickled = self._pickled.get(id(object))
        if pickled is None:
            pickled = self._pickled[id(object)] = super().transform_object(write_item, object).getvalue()
        return io.BytesIO(pickled)

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
        if len(md.chunks) == 1 and _is_whole(md.chunks[0], md.size):
            continue  # one chunk that is the whole tensor (most keys): nothing to cut or cover
        problem = chunk_problem(key, tuple(md.size), [(c.offsets, c.sizes) for c in md.chunks], overlap=overlap)
        if problem is not None:
            problems.append(problem)
    return problems


def _is_whole(chunk, shape) -> bool:
    return chunk.sizes == shape and not any(chunk.offsets) and len(chunk.offsets) == len(shape)


def chunk_problem(
    key: str, shape: tuple[int, ...], chunks: list[tuple[Sequence[int], Sequence[int]]], *, overlap: bool = True
) -> str | None:
    """What is wrong with ``chunks`` (``(offsets, sizes)`` each) as a cover of a tensor of ``shape``, or ``None``.

    Linear in the number of chunks whatever their number of dims (see :func:`_first_miscovered`).
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
        try:
            element = _first_miscovered(shape, chunks)
        except _TooFragmented:
            return (
                f"{key}: its {len(chunks)} chunks (shape {list(shape)}) are too fragmented to check that they cover "
                "it exactly once at a cost linear in their number; DCP and this library never write such a layout"
            )
        if element is not None:
            return _miscover_sentence(key, shape, chunks, element, volume)
    if volume > numel:
        return (
            f"{key}: chunks hold {volume} elements, more than its {numel} (shape {list(shape)}); some are stored twice"
        )
    if volume < numel:
        return f"{key}: chunks hold {volume} of its {numel} elements (shape {list(shape)}); a rank's part is missing"
    return None


_COVER_STEPS_PER_CHUNK_DIM = 32
"""The (box, slab) visits the cover check of one tensor may make over non-contiguous chunks, per chunk and dim
(plus :data:`_COVER_STEPS_MIN`): what a file can make a load spend is linear in its chunks. A grid of DTensor
shards needs about one visit per chunk and dim; shards of different widths each cut by ``max_chunk_bytes``
about one per chunk and rank sharing their rows."""
_COVER_STEPS_MIN = 1 << 16


class _TooFragmented(Exception):
    pass


def _first_miscovered(shape: tuple[int, ...], chunks) -> tuple[int, ...] | None:
    """The first element (row-major) not covered exactly once, or ``None``. Precondition: chunks inside ``shape``.

    Linear in the chunks (plus a sort), whatever the number of dims. When every
    chunk is one contiguous run of the row-major order (row blocks, flat
    ranges: what FSDP writes), the runs sorted by start must follow each other
    exactly. Otherwise :func:`_first_miscovered_box` cuts the tensor into slabs.
    Raises :class:`_TooFragmented` past a budget linear in the chunks (:data:`_COVER_STEPS_PER_CHUNK_DIM`).
    """
    if not math.prod(shape):
        return None  # nothing to cover; every chunk inside it is empty too
    boxes = [(tuple(offsets), tuple(sizes)) for offsets, sizes in chunks if math.prod(sizes)]
    runs = [run for offsets, sizes in boxes if (run := _as_run(shape, offsets, sizes)) is not None]
    if len(runs) == len(boxes):
        flat = _first_miscovered_run(sorted(runs), math.prod(shape))
        return None if flat is None else _unflatten(flat, shape)
    budget = _COVER_STEPS_PER_CHUNK_DIM * len(boxes) * len(shape) + _COVER_STEPS_MIN
    return _first_miscovered_box(shape, boxes, 0, (), [budget])


def _as_run(shape, offsets, sizes) -> tuple[int, int] | None:
    """``(first element, length)`` of a box that is one contiguous run of the row-major order, else ``None``."""
    split = next((d for d, s in enumerate(sizes) if s != 1), len(sizes))  # leading dims of size 1 are one index
    if any(offsets[d] or sizes[d] != shape[d] for d in range(split + 1, len(shape))):
        return None  # a dim after the first wide one is not whole: the box has gaps in row-major order
    start = 0
    for offset, size in zip(offsets, shape):
        start = start * size + offset
    return start, math.prod(sizes)


def _first_miscovered_run(runs: list[tuple[int, int]], numel: int) -> int | None:
    """The first flat index not covered exactly once by ``runs`` (sorted by start), or ``None``."""
    covered = 0  # [0, covered) is covered exactly once
    for start, length in runs:
        if start != covered:
            return min(start, covered)  # a gap at ``covered``, or ``start`` held by this run and the one before
        covered = start + length
    return None if covered == numel else covered


def _unflatten(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    element = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        element.append(i)
    return tuple(reversed(element))


def _first_miscovered_box(shape, boxes, dim: int, prefix: tuple[int, ...], steps: list[int]):
    """The first element not covered once by ``boxes``, which all hold the whole of dims ``dim`` on at ``prefix``.

    Cuts dim ``dim`` at every box's bounds: within one slab each box holds all or
    nothing, so the slab is covered once exactly when the boxes holding it cover
    the remaining dims once (recursively); slabs in order give the row-major
    first element. ``steps[0]``: the (box, slab) visits left.
    """
    if dim == len(shape):
        return None if len(boxes) == 1 else prefix  # held by two or more boxes
    steps[0] -= len(boxes)  # the cuts and the sort
    cuts = sorted({0, shape[dim], *(o[dim] for o, _ in boxes), *(o[dim] + s[dim] for o, s in boxes)})
    pending = sorted(boxes, key=lambda box: box[0][dim], reverse=True)  # popped in order of start
    holding: list = []
    for low in cuts[:-1]:
        holding = [box for box in holding if box[0][dim] + box[1][dim] > low]
        while pending and pending[-1][0][dim] == low:
            holding.append(pending.pop())
        steps[0] -= len(holding) + 1
        if steps[0] < 0:
            raise _TooFragmented
        if not holding:
            return (*prefix, low) + (0,) * (len(shape) - dim - 1)
        found = _first_miscovered_box(shape, holding, dim + 1, (*prefix, low), steps)
        if found is not None:
            return found
    return None


def _miscover_sentence(key, shape, chunks, element, volume) -> str:
    holders = [list(o) for o, s in chunks if all(a <= e < a + n for a, n, e in zip(o, s, element))]
    assert len(holders) != 1, f"{key}: element {element} flagged but covered once"
    if holders:
        return f"{key}: chunks at {holders[0]} and {holders[1]} overlap (element {list(element)} is stored {len(holders)} times)"
    return (
        f"{key}: chunks hold {volume} of its {math.prod(shape)} elements (shape {list(shape)}) and element "
        f"{list(element)} is in none; a rank's part is missing"
    )
