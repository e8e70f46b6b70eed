"""The one chunk-coverage check (checkpoint/planner.py), used by commit and by `fsdp-ckpt verify`.

Reference: a plain count tensor, each chunk adding 1 over its box.
"""

import math
import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.layout import flat_range_to_boxes
from checkpoint.manifest import MANIFEST_NAME, METADATA_NAME
from checkpoint.planner import chunk_problem
from checkpoint.tool.rewrite import write_checkpoint
from checkpoint.tool.transforms import Target


def _counts(shape, chunks) -> torch.Tensor:
    counts = torch.zeros(shape, dtype=torch.int32)
    for offsets, sizes in chunks:
        counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return counts


def _first_bad(counts: torch.Tensor) -> list[int] | None:
    bad = (counts.reshape(-1) != 1).nonzero()
    if not len(bad):
        return None
    return [int(i) for i in torch.unravel_index(bad[0, 0], counts.shape)] if counts.dim() else []


@st.composite
def boxes_in_a_shape(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    chunks = []
    for _ in range(draw(st.integers(0, 5))):
        offsets = tuple(draw(st.integers(0, g - 1)) for g in shape)
        sizes = tuple(draw(st.integers(0, g - o)) for o, g in zip(offsets, shape))
        chunks.append((offsets, sizes))
    return shape, chunks


def _maybe_disturb(draw, shape: tuple[int, ...], chunks: list) -> None:
    """Perhaps one box of ``chunks`` dropped, repeated or shifted by one along a dim (in place)."""
    change = draw(st.sampled_from(["none", "drop", "repeat", "shift"]))
    i = draw(st.integers(0, len(chunks) - 1))
    if change == "drop":
        del chunks[i]
    elif change == "repeat":
        chunks.append(chunks[i])
    elif change == "shift":  # same volume, so only an overlap / hole check can notice
        offsets, sizes = chunks[i]
        d = draw(st.integers(0, len(shape) - 1))
        if offsets[d] + sizes[d] < shape[d]:
            chunks[i] = (offsets[:d] + (offsets[d] + 1,) + offsets[d + 1 :], sizes)


@st.composite
def a_tiling_maybe_disturbed(draw):
    """Flat ranges cut at random points (an exact cover), then perhaps one box moved, dropped or repeated."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    numel = math.prod(shape)
    cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=4)))
    bounds = [0, *cuts, numel]
    chunks = [(b.offsets, b.sizes) for lo, hi in zip(bounds, bounds[1:]) for b in flat_range_to_boxes(shape, lo, hi)]
    _maybe_disturb(draw, shape, chunks)
    return shape, chunks


@st.composite
def a_grid_maybe_disturbed(draw):
    """Every dim cut at random points, each box of a cell then perhaps cut once more along its own dim (as DTensor
    shards split by a chunk-size limit are): an exact cover of boxes that are mostly not contiguous runs, then
    perhaps one box dropped, repeated or shifted."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=5)))
    cells = [((), ())]
    for g in shape:
        bounds = sorted({0, g, *draw(st.lists(st.integers(0, g), max_size=2))})
        cells = [(o + (lo,), s + (hi - lo,)) for o, s in cells for lo, hi in zip(bounds, bounds[1:])]
    chunks = []
    for offsets, sizes in cells:
        d = draw(st.integers(0, len(shape) - 1))
        cut = draw(st.integers(0, sizes[d]))
        for lo, n in ((0, cut), (cut, sizes[d] - cut)):
            if n:
                chunks.append((offsets[:d] + (offsets[d] + lo,) + offsets[d + 1 :], sizes[:d] + (n,) + sizes[d + 1 :]))
    _maybe_disturb(draw, shape, chunks)
    return shape, chunks


@settings(max_examples=400, deadline=None)
@given(st.one_of(boxes_in_a_shape(), a_tiling_maybe_disturbed(), a_grid_maybe_disturbed()))
def test_cover_check_passes_exactly_when_every_element_is_in_one_chunk_and_names_the_first_bad_one(case):
    shape, chunks = case
    counts = _counts(shape, chunks)
    first = _first_bad(counts)
    problem = chunk_problem("model.w", shape, chunks)
    if first is None:
        assert problem is None
        return
    assert problem is not None and problem.startswith("model.w: ")
    assert f"element {first}" in problem
    if counts[tuple(first)] > 1:
        assert f"overlap (element {first} is stored {int(counts[tuple(first)])} times)" in problem
    else:
        assert f"element {first} is in none" in problem


def test_cover_check_names_chunks_that_leave_the_shape_or_have_the_wrong_rank():
    assert (
        chunk_problem("k", (4, 3), [((0, 0), (4, 3)), ((3, 2), (1, 2))])
        == "k: chunk at [3, 2] of size [1, 2] leaves shape [4, 3]"
    )
    assert "leaves shape [4, 3]" in chunk_problem("k", (4, 3), [((0,), (4,))])


def test_volume_only_check_misses_a_same_volume_overlap_that_the_full_check_names():
    shape = (4, 3)
    chunks = [((0, 0), (2, 3)), ((1, 0), (2, 3))]  # row 1 twice, row 3 never: 12 elements all the same
    assert chunk_problem("k", shape, chunks, overlap=False) is None
    assert (
        chunk_problem("k", shape, chunks) == "k: chunks at [0, 0] and [1, 0] overlap (element [1, 0] is stored 2 times)"
    )
    assert chunk_problem("k", shape, chunks[:1], overlap=False) == (
        "k: chunks hold 6 of its 12 elements (shape [4, 3]); a rank's part is missing"
    )


def test_verify_exits_with_found_problems_naming_a_key_whose_chunks_overlap(tmp_path, cli):
    path = tmp_path / "ck"
    value = torch.arange(12.0).reshape(4, 3)
    target = Target("model.w", "tensor", value.dtype, (4, 3), ("model.w",))
    write_checkpoint(path, 2, [target], [(target, value)])  # rows [0, 2) on rank 0, [2, 4) on rank 1
    metadata = pickle.loads((path / METADATA_NAME).read_bytes())
    md = metadata.state_dict_metadata["model.w"]
    md.chunks[1] = type(md.chunks[1])(offsets=torch.Size((1, 0)), sizes=md.chunks[1].sizes)  # rows 1-2: overlap + hole
    (path / METADATA_NAME).write_bytes(pickle.dumps(metadata))
    (path / MANIFEST_NAME).unlink()  # a plain DCP directory, so only the chunk check can object
    proc = cli("verify", path, check=1)
    assert "PROBLEM model.w: chunks at [0, 0] and [1, 0] overlap (element [1, 0] is stored 2 times)" in proc.stdout
