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
    # one value keyed twice (a param group's options in torch's flattened layout): stored once, and the
    # manifest lists "groups.b.lr" by the value it shares with "groups.a.lr"
    "groups": {"a": {"lr": 0.125}, "b": {"lr": 0.125}},
}


def _target() -> dict:
    return {
        "w": torch.full((64, 8), -1.0),
        "b": torch.zeros(10),
        "v": torch.zeros(10),
        "n": None,
        "opt": {"lr": None, "eps": None},
        "extra": {"first": None, "second": None},
        "groups": {"a": {"lr": None}, "b": {"lr": None}},
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


def a_shared_value_pointed_at_another_value(md) -> None:
    md.storage_data[MetadataIndex("groups.b.lr")] = md.storage_data[MetadataIndex("opt.eps")]


def a_shared_value_renested(md) -> None:
    md.planner_data["groups.b.lr"] = ("groups", "c", "lr")


def the_source_of_a_shared_value_moved_with_it(md) -> None:
    # both keys still share one range, but not the one the manifest pinned for the source
    md.storage_data[MetadataIndex("groups.a.lr")] = md.storage_data[MetadataIndex("opt.eps")]
    md.storage_data[MetadataIndex("groups.b.lr")] = md.storage_data[MetadataIndex("opt.eps")]


_RELABELLINGS = {
    two_same_size_chunks_swapped: "'w'",
    two_row_blocks_swapped: "'w'",
    two_tensors_swapped: "'b'",
    two_option_values_swapped: "'opt.lr'",
    two_extra_names_swapped: "'extra.first'",
    float32_relabelled_int32_in_the_manifest_too: "'w'",
    a_shared_value_pointed_at_another_value: "'groups.b.lr'",
    a_shared_value_renested: "'groups.b.lr'",
    the_source_of_a_shared_value_moved_with_it: "'groups.a.lr'",
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
    assert target["groups"] == _SAVED["groups"]
    assert read_manifest(good).shared_keys() == {"groups.b.lr": ("groups.a.lr", ("groups", "b", "lr"))}
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


def _without_identities(good: Path, root: Path, keys, *, pinned: bool = True) -> Path:
    """A copy of ``good`` whose manifest lacks the identities of ``keys(manifest)`` and, unless ``pinned``,
    the CRC-32 of the ``.metadata`` its records were made from (as manifests written before 2026-11)."""
    ck = root / "ck"
    shutil.copytree(good, ck)
    manifest = read_manifest(ck)
    for key in keys(manifest):
        manifest.keys[key] = dataclasses.replace(manifest.keys[key], identity=None)
    if not pinned:
        manifest = dataclasses.replace(manifest, keys_from_metadata_crc32=None)
    write_manifest(ck, manifest)
    return ck


def test_a_manifest_written_before_identities_still_loads_and_verifies(good, tmp_path, capsys):
    ck = _without_identities(good, tmp_path, lambda manifest: list(manifest.keys), pinned=False)
    assert '"identity"' not in (ck / "manifest.json").read_text()
    assert "keys_from_metadata_crc32" not in (ck / "manifest.json").read_text()
    target = _target()
    checkpoint.load_state_dict(target, ck, no_dist=True)
    assert torch.equal(target["w"], _SAVED["w"]) and target["extra"] == _SAVED["extra"]
    assert cli_main(["verify", str(ck)]) == 0


def test_a_manifest_with_one_identity_stripped_is_refused_naming_the_key(good, tmp_path, capsys):
    # stripped to pass off a relabelling of w's chunks (.metadata rewritten, its file record recomputed)
    ck = _tampered(good, tmp_path, two_same_size_chunks_swapped)
    manifest = read_manifest(ck)
    manifest.keys["w"] = dataclasses.replace(manifest.keys["w"], identity=None)
    write_manifest(ck, manifest)
    with pytest.raises(checkpoint.CheckpointCorruptError, match="'w' has no identity in manifest.json"):
        checkpoint.load_state_dict(_target(), ck, no_dist=True)
    assert cli_main(["verify", str(ck)]) == 1
    assert "'w' has no identity in manifest.json" in capsys.readouterr().out


def test_a_relabelling_is_refused_under_a_manifest_without_the_pin_too(good, tmp_path):
    ck = _tampered(good, tmp_path, two_tensors_swapped)
    write_manifest(ck, dataclasses.replace(read_manifest(ck), keys_from_metadata_crc32=None))  # before 2026-11
    with pytest.raises(checkpoint.CheckpointCorruptError, match="'b' is not stored as manifest.json recorded it"):
        checkpoint.load_state_dict(_target(), ck, no_dist=True)


def test_key_records_edited_alone_load_exactly_and_fail_verify(good, tmp_path, capsys):
    """``.metadata`` still the one the records were made from (``keys_from_metadata_crc32``): a load reads
    exactly what was saved without comparing the records key by key; ``fsdp-ckpt verify`` compares them."""
    ck = _without_identities(good, tmp_path, lambda manifest: ["w"])
    manifest = read_manifest(ck)
    assert manifest.keys_from_metadata_crc32 == manifest.files[METADATA_NAME].crc32
    target = _target()
    checkpoint.load_state_dict(target, ck, no_dist=True)
    assert torch.equal(target["w"], _SAVED["w"]) and target["groups"] == _SAVED["groups"]
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


# --------------------------------------------------------------------------- a .metadata that would change the loader
# Each poison is a few pickle opcodes run before DCP's own (then popped): plain pickle.loads of the file
# applies it and returns the usual Metadata, so the checkpoint would load normally with the process changed.


def _global(module: str, name: str) -> bytes:
    return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"


def _str(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


_FROZENSET = _global("builtins", "frozenset")
_DCP = "torch.distributed.checkpoint.metadata"


class _Probe:
    """One global a poison would change: ``unchanged()`` checks it, ``restore()`` undoes a poison that got through."""

    def __init__(self, poison: bytes, target, name: str) -> None:
        self.poison, self.target, self.name = poison, target, name
        self.before = vars(target).get(name, _Probe)

    def unchanged(self) -> bool:
        return vars(self.target).get(self.name, _Probe) is self.before

    def restore(self) -> None:
        if self.before is _Probe:
            if self.name in vars(self.target):
                delattr(self.target, self.name)
        elif not self.unchanged():
            setattr(self.target, self.name, self.before)


def _path_exists() -> _Probe:
    """BUILD with slot state on a class: setattr(PosixPath, "exists", frozenset)."""
    import pathlib

    return _Probe(
        _global("pathlib", "PosixPath") + b"N}" + _str("exists") + _FROZENSET + b"s\x86b0", pathlib.PosixPath, "exists"
    )


def _layout_cache() -> _Probe:
    """BUILD with dict state on a function: _get_layout.cache = {"torch.strided": torch.sparse_coo}."""
    poison = _global("torch.serialization", "_get_layout") + b"}" + _str("cache") + b"}" + _str("torch.strided")
    poison += _global("torch", "sparse_coo") + b"ssb0"
    return _Probe(poison, torch.serialization._get_layout, "cache")


def _metadata_class_method() -> _Probe:
    """BUILD with slot state on one of DCP's own metadata classes: MetadataIndex.__eq__ = frozenset."""
    poison = _global(_DCP, "MetadataIndex") + b"N}" + _str("__eq__") + _FROZENSET + b"s\x86b0"
    return _Probe(poison, MetadataIndex, "__eq__")


def _enum_member_value() -> _Probe:
    """BUILD on the shared enum member a call returns: _MEM_FORMAT_ENCODING(0)._value_ = 7 (every later save)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    poison = _global(_DCP, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R}" + _str("_value_") + b"K\x07sb0"
    return _Probe(poison, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, "_value_")


@pytest.mark.parametrize("probe", [_path_exists, _layout_cache, _metadata_class_method, _enum_member_value])
def test_a_metadata_that_would_change_the_loading_program_is_refused_and_changes_nothing(good, tmp_path, probe):
    import pathlib

    probe = probe()
    ck = tmp_path / "ck"
    shutil.copytree(good, ck)
    original = (ck / METADATA_NAME).read_bytes()
    (ck / METADATA_NAME).write_bytes(original[:2] + probe.poison + original[2:])  # after PROTO: the poison, popped
    manifest = read_manifest(ck)
    from checkpoint.manifest import checksum_file

    manifest.files[METADATA_NAME] = checksum_file(ck / METADATA_NAME)  # the manifest vouches for the poisoned bytes
    write_manifest(ck, manifest)
    target = {"w": torch.zeros(64, 8), "b": torch.zeros(10), "n": None}
    try:
        with pytest.raises(checkpoint.CheckpointCorruptError, match=r"\.metadata: cannot be read.*refused"):
            checkpoint.load_state_dict(target, ck, no_dist=True)
        assert probe.unchanged(), f"loading changed {probe.target!r}.{probe.name}"
        assert pathlib.Path("/").exists() is True
        assert torch.serialization._get_layout("torch.strided") is torch.strided
    finally:
        probe.restore()  # a regression must fail this test, not every later one


# --------------------------------------------------------------------------- bounded cost of a load: counted, not timed
# A load of a small checkpoint runs about 10-20k Python lines and allocates well under 1 MiB (the destination
# tensors aside); the check that chunks cover their tensor used to cost 2**ndim per chunk (a 22-dim tensor:
# 8M corners, 58 s; 30 dims: out of memory).
_LINES = 300_000
_BYTES = 64 << 20


def _counted(fn, max_lines: int = _LINES):
    from tests.bounded import WorkBudgetExceeded, run_counted

    returned, raised, lines, peak = run_counted(fn, max_lines=max_lines, max_bytes=_BYTES)
    assert not isinstance(raised, WorkBudgetExceeded), f"{raised} ({lines} lines, {peak} bytes at peak)"
    print(f"{lines} Python lines, {peak} bytes at peak")
    return returned, raised


def test_a_saved_22_dim_tensor_loads_exactly_within_a_counted_budget(tmp_path):
    saved = torch.randint(0, 255, (2,) * 22, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    checkpoint.save_state_dict({"t": saved}, tmp_path / "ck")
    back = {"t": torch.zeros_like(saved)}
    _, raised = _counted(lambda: checkpoint.load_state_dict(back, tmp_path / "ck", no_dist=True))
    assert raised is None and torch.equal(back["t"], saved)


def _reshape_in_metadata(ck: Path, key: str, shape: tuple[int, ...], boxes: list[tuple[tuple, tuple]]) -> None:
    """Give ``key`` another shape and chunks in ``.metadata`` and the manifest, every chunk on the bytes of the first."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_metadata(ck / METADATA_NAME, (ck / METADATA_NAME).read_bytes())
    item = metadata.state_dict_metadata[key]
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    info = metadata.storage_data.pop(index)
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    metadata.state_dict_metadata[key] = TensorStorageMetadata(item.properties, torch.Size(shape), chunks)
    for chunk in chunks:
        metadata.storage_data[MetadataIndex(key, chunk.offsets)] = info
    manifest = read_manifest(ck)
    manifest.files[METADATA_NAME] = write_metadata(ck, metadata)
    manifest.keys[key] = dataclasses.replace(manifest.keys[key], shape=tuple(shape))
    write_manifest(ck, manifest)


def test_a_tampered_24_dim_tensor_loads_exactly_or_is_refused_within_a_counted_budget(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save_state_dict({"t": torch.tensor([5.0])}, ck)
    _reshape_in_metadata(ck, "t", (1,) * 24, [((0,) * 24, (1,) * 24)])  # the same one element, 24 dims deep
    back = {"t": torch.zeros((1,) * 24)}
    _, raised = _counted(lambda: checkpoint.load_state_dict(back, ck, no_dist=True))
    # the manifest pins each chunk's place, so the relabelling is refused; either way, exact or clear, and cheap
    if raised is None:
        assert back["t"].item() == 5.0
    else:
        assert isinstance(raised, checkpoint.CheckpointCorruptError) and ".metadata" in str(raised), raised


@pytest.mark.parametrize(
    "boxes",
    [
        [((0,) * 30, (2,) * 29 + (1,)), ((0,) * 29 + (1,), (2,) * 29 + (1,))],  # halves of the last dim
        [((0,) * 30, (2,) * 29 + (1,)), ((0,) * 30, (2,) * 29 + (1,))],  # one half twice, the other in none
    ],
    ids=["exact cover", "overlap and hole"],
)
def test_a_tampered_30_dim_tensor_is_refused_clearly_within_a_counted_budget(tmp_path, boxes, capsys):
    ck = tmp_path / "ck"
    checkpoint.save_state_dict({"t": torch.tensor([5.0])}, ck)
    _reshape_in_metadata(ck, "t", (2,) * 30, boxes)  # 2**30 elements claimed, 1 stored
    _, raised = _counted(lambda: checkpoint.open_checkpoint(ck))
    assert isinstance(raised, checkpoint.CheckpointCorruptError) and ".metadata" in str(raised), raised
    code, raised = _counted(lambda: cli_main(["verify", str(ck)]))
    assert raised is None and code != 0, capsys.readouterr()


def test_chunks_too_fragmented_to_check_are_a_clear_error_not_an_unbounded_cost():
    """An exact cover no writer produces: k column boxes beside k row boxes cut dim 0 into k slabs of k + 1."""
    from checkpoint.planner import chunk_problem

    k = 1500  # checked slab by slab: over 4M box visits; the budget (linear in chunks): about 0.25M
    boxes = [((0, j), (k, 1)) for j in range(k)] + [((i, k), (1, k)) for i in range(k)]
    problem, raised = _counted(lambda: chunk_problem("w", (k, 2 * k), boxes), max_lines=3_000_000)
    assert raised is None and problem is not None and "w: " in problem and "too fragmented" in problem, problem
