"""Pure functions from a rank's region of a global tensor to DCP chunk boxes.

A rank knows the global shape of a tensor and its own region of it: a row
block, a general box, or a flat range ``[start, end)`` of the row-major
order. DCP stores rectangular chunks, so each region is turned into boxes
here, locally, without talking to any other rank:

* a box is already a chunk;
* a flat range becomes at most ``2 * ndim - 1`` boxes (a partial run at the
  start, one block of whole rows, a partial run at the end, recursively),
  each of which is one contiguous run of the row-major order;
* an empty region becomes no box at all.

:func:`split_box` then bounds the bytes per chunk, so a later reshard never has
to read a huge chunk to fill a small local shard.

Nothing here touches tensors' data; everything is integers and tuples.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = [
    "Box",
    "box_flat_start",
    "box_numel",
    "flat_range_to_boxes",
    "region_boxes",
    "row_block",
    "split_box",
]


class Box(NamedTuple):
    """A rectangular region of a global tensor: ``offsets`` and ``sizes`` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def box_numel(box: Box) -> int:
    return math.prod(box.sizes)


def row_block(global_shape: tuple[int, ...], start_row: int, num_rows: int) -> Box:
    """The box of rows ``[start_row, start_row + num_rows)`` of dim 0 (an FSDP2 ``Shard(0)`` shard)."""
    if not global_shape:
        raise ValueError("a row block needs a tensor with at least one dim")
    if start_row < 0 or num_rows < 0 or start_row + num_rows > global_shape[0]:
        raise ValueError(f"rows [{start_row}, {start_row + num_rows}) leave dim 0 of shape {global_shape}")
    return Box((start_row,) + (0,) * (len(global_shape) - 1), (num_rows,) + tuple(global_shape[1:]))


def box_flat_start(global_shape: tuple[int, ...], box: Box) -> int:
    """Row-major index of the box's first element in the global tensor."""
    index = 0
    for offset, size in zip(box.offsets, global_shape):
        index = index * size + offset
    return index


def flat_range_to_boxes(global_shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Boxes covering elements ``[start, end)`` of the row-major order, in that order.

    At most ``2 * ndim - 1`` boxes (one for a 0-d tensor); none when the range
    is empty. Each box is one contiguous run of the row-major order, so the
    matching piece of a flat local buffer is a plain slice.
    """
    numel = math.prod(global_shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {numel} elements (shape {global_shape})")
    if start == end:
        return []
    return _flat_boxes(tuple(global_shape), start, end)


def _flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    if start == end:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    rest_zeros = (0,) * (len(shape) - 1)
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(end, inner)
    if first_row == last_row:
        # The whole range sits inside one row: recurse into that row.
        return [Box((first_row,) + b.offsets, (1,) + b.sizes) for b in _flat_boxes(shape[1:], first_col, last_col)]
    boxes: list[Box] = []
    if first_col:
        boxes += [Box((first_row,) + b.offsets, (1,) + b.sizes) for b in _flat_boxes(shape[1:], first_col, inner)]
        first_row += 1
    if last_row > first_row:
        boxes.append(Box((first_row,) + rest_zeros, (last_row - first_row,) + shape[1:]))
    if last_col:
        boxes += [Box((last_row,) + b.offsets, (1,) + b.sizes) for b in _flat_boxes(shape[1:], 0, last_col)]
    return boxes


def region_boxes(
    global_shape: tuple[int, ...],
    *,
    offsets: tuple[int, ...] | None = None,
    local_shape: tuple[int, ...] | None = None,
    flat_start: int | None = None,
    local_numel: int | None = None,
) -> list[Box]:
    """Boxes of one region: a box (``offsets`` + ``local_shape``) or a flat range (``flat_start`` + ``local_numel``)."""
    if flat_start is not None:
        if local_numel is None:
            raise ValueError("a flat range needs local_numel")
        return flat_range_to_boxes(tuple(global_shape), flat_start, flat_start + local_numel)
    if offsets is None or local_shape is None:
        raise ValueError("a box region needs offsets and local_shape")
    if len(offsets) != len(global_shape) or len(local_shape) != len(global_shape):
        raise ValueError(f"box offsets {offsets} / sizes {local_shape} do not match the rank of shape {global_shape}")
    for o, s, g in zip(offsets, local_shape, global_shape):
        if o < 0 or s < 0 or o + s > g:
            raise ValueError(f"box at {offsets} of size {local_shape} leaves the global shape {global_shape}")
    if math.prod(local_shape) == 0 and math.prod(global_shape) != 0:
        return []
    return [Box(tuple(offsets), tuple(local_shape))]


def split_box(box: Box, itemsize: int, max_bytes: int | None) -> list[Box]:
    """Cut ``box`` into boxes of at most ``max_bytes`` each (whole elements), in row-major order.

    Cuts along the first dim with more than one element, as coarsely as the
    limit allows, and only goes one dim deeper when a single slice along that
    dim is already over the limit. A contiguous box stays cut into contiguous
    boxes. ``max_bytes=None`` returns ``[box]``.
    """
    if max_bytes is None or box_numel(box) * itemsize <= max_bytes:
        return [box]
    if max_bytes < itemsize:
        raise ValueError(f"max chunk size {max_bytes} B is smaller than one element ({itemsize} B)")
    dim = next((d for d, s in enumerate(box.sizes) if s > 1), None)
    if dim is None:
        return [box]
    slice_bytes = math.prod(box.sizes[dim + 1 :]) * itemsize
    step = max(1, max_bytes // slice_bytes)
    pieces: list[Box] = []
    for lo in range(0, box.sizes[dim], step):
        n = min(step, box.sizes[dim] - lo)
        offsets = box.offsets[:dim] + (box.offsets[dim] + lo,) + box.offsets[dim + 1 :]
        sizes = box.sizes[:dim] + (n,) + box.sizes[dim + 1 :]
        piece = Box(offsets, sizes)
        pieces += split_box(piece, itemsize, max_bytes) if slice_bytes > max_bytes else [piece]
    return pieces
