"""Property tests of the pure region -> chunk functions (checkpoint/layout.py) and shard views."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.layout import (
    Box,
    box_flat_start,
    flat_range_to_boxes,
    region_boxes,
    row_block,
    split_box,
)
from checkpoint.shard import local_view, shard
from offload_fsdp.shard_spec import ShardSpec

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def shape_and_range(draw):
    shape = draw(shapes)
    numel = math.prod(shape)
    start = draw(st.integers(0, numel))
    end = draw(st.integers(start, numel))
    return shape, start, end


def _cover_counts(shape, boxes) -> torch.Tensor:
    counts = torch.zeros(shape, dtype=torch.int32)
    for box in boxes:
        index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        counts[index] += 1
    return counts


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_flat_range_boxes_cover_the_range_exactly_in_at_most_2n_minus_1_contiguous_boxes(case):
    shape, start, end = case
    boxes = flat_range_to_boxes(shape, start, end)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    expected = torch.zeros(math.prod(shape), dtype=torch.int32)
    expected[start:end] = 1
    assert torch.equal(_cover_counts(shape, boxes).reshape(-1), expected)  # exact cover, no overlap
    position = start
    for box in boxes:  # each box is the next contiguous run of the row-major order
        assert math.prod(box.sizes) > 0
        assert box_flat_start(shape, box) == position
        position += math.prod(box.sizes)
    assert position == end


@settings(max_examples=200, deadline=None)
@given(shape_and_range())
def test_local_views_of_a_flat_shard_round_trip_to_the_global_tensor(case):
    shape, start, end = case
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    local = full.reshape(-1)[start:end].clone()
    spec = ShardSpec(shape, flat_start=start)
    rebuilt = torch.full(shape, -1.0)
    for box in flat_range_to_boxes(shape, start, end):
        index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        view = local_view(local, spec, box)
        assert torch.equal(view, full[index])
        rebuilt[index] = view
        view.fill_(7)  # views write through to the local buffer (what an in-place load relies on)
    assert torch.equal(rebuilt.reshape(-1)[start:end], full.reshape(-1)[start:end])
    assert bool((local == 7).all())


@settings(max_examples=200, deadline=None)
@given(shapes.filter(lambda s: len(s) > 0), st.integers(1, 64), st.data())
def test_split_box_bounds_bytes_and_covers_the_box_exactly(shape, max_elems, data):
    offsets = tuple(data.draw(st.integers(0, s)) for s in shape)
    sizes = tuple(data.draw(st.integers(0, s - o)) for s, o in zip(shape, offsets))
    box = Box(offsets, sizes)
    pieces = split_box(box, 4, max_elems * 4)
    assert all(math.prod(p.sizes) <= max(max_elems, 1) for p in pieces)
    expected = _cover_counts(shape, [box])
    assert torch.equal(_cover_counts(shape, pieces), expected)


def test_split_box_keeps_contiguous_runs_contiguous():
    shape = (6, 5, 4)
    for box in flat_range_to_boxes(shape, 7, 101):
        start = box_flat_start(shape, box)
        for piece in split_box(box, 2, 2 * 6):
            assert box_flat_start(shape, piece) == start
            start += math.prod(piece.sizes)


def test_empty_regions_produce_no_chunk():
    assert flat_range_to_boxes((4, 3), 5, 5) == []
    assert region_boxes((4, 3), offsets=(4, 0), local_shape=(0, 3)) == []
    assert shard(torch.empty(0), (4, 3), flat_start=12).__create_chunk_list__() == []


def test_row_block_and_box_regions_are_one_chunk():
    assert row_block((5, 3), 2, 2) == Box((2, 0), (2, 3))
    assert region_boxes((5, 3), offsets=(1, 1), local_shape=(2, 2)) == [Box((1, 1), (2, 2))]
    with pytest.raises(ValueError, match="leaves"):
        region_boxes((5, 3), offsets=(4, 0), local_shape=(2, 3))


def test_flat_range_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_boxes((2, 3), 4, 7)


def test_a_checkpoint_shard_refuses_arithmetic():
    s = shard(torch.ones(2, 3), (4, 3), offsets=(2, 0))
    assert tuple(s.shape) == (4, 3) and "CheckpointShard" in repr(s)
    with pytest.raises(TypeError, match="local"):
        torch.add(s, 1)
