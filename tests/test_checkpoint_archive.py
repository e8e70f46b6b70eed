"""Chunks written from raw bytes: torch.load / plain DCP read them, CRCs are right, odd tensors still work."""

import io
import os
import zipfile
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoint
from checkpoint.chunk_archive import plan_archive
from checkpoint.content_check import _crc32_combine_python, crc32_combine
from checkpoint.manifest import read_manifest


def _archive(tensor: torch.Tensor) -> bytes:
    layout = plan_archive(tensor)
    assert layout is not None
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return layout.head + data + layout.tail(zlib.crc32(data))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(5, 7),
        torch.arange(10, dtype=torch.bfloat16),
        torch.tensor(3.5, dtype=torch.float64),
        torch.zeros(0, 4),
        torch.ones(2, 3, 4, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64),
    ],
    ids=["f32", "bf16", "0d", "empty", "i64-3d", "bool", "c64"],
)
def test_a_raw_archive_is_a_valid_zip_that_torch_load_reads_back_exactly(tensor):
    blob = _archive(tensor)
    assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None  # every record's zip CRC is right
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape and torch.equal(loaded, tensor)
    # Same member names as torch.save, so tools that look for them find them.
    reference = io.BytesIO()
    torch.save(tensor, reference)
    ours = zipfile.ZipFile(io.BytesIO(blob)).namelist()
    assert sorted(ours) == sorted(zipfile.ZipFile(io.BytesIO(reference.getvalue())).namelist())


def test_a_raw_archive_keeps_its_data_aligned_for_mmap_loads_and_is_smaller_than_torch_save(tmp_path):
    tensor = torch.randn(419)
    blob = _archive(tensor)
    (data,) = [i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if i.filename.endswith("/data/0")]
    name_and_extra = len(data.filename.encode()) + int.from_bytes(
        blob[data.header_offset + 28 : data.header_offset + 30], "little"
    )
    assert (data.header_offset + 30 + name_and_extra) % 64 == 0  # torch.load(mmap=True) maps the storage there
    (tmp_path / "t.pt").write_bytes(blob)
    assert torch.equal(torch.load(tmp_path / "t.pt", mmap=True, weights_only=True), tensor)
    reference = io.BytesIO()
    torch.save(tensor, reference)
    assert len(blob) < len(reference.getvalue())  # only the data record is padded


def test_crc32_combine_equals_the_crc_of_the_concatenation():
    pieces = [b"", b"x", os.urandom(1), os.urandom(1000), os.urandom(70_001)]
    # the library's combine (ISA-L's where installed) and the pure-Python one used where isal is not
    for combine in (crc32_combine, _crc32_combine_python):
        for a in pieces:
            for b in pieces:
                assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert combine(0x1234, 0x5678, (1 << 40) + 17) == _crc32_combine_python(0x1234, 0x5678, (1 << 40) + 17)


def test_views_transposes_and_dtypes_without_a_storage_class_save_and_read_back_everywhere(tmp_path):
    base = torch.randn(8, 6)
    state = {
        "view": base[2:5],  # a view into a larger storage: only its rows are stored
        "transposed": torch.randn(4, 3).t(),  # not row-major
        "bf16": torch.randn(5, 2).to(torch.bfloat16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),  # no legacy storage class: torch.save path
        "n": 3,
    }
    checkpoint.save_state_dict(state, tmp_path / "c")
    # verify="full" recomputes every file's CRC-32: the combined CRC the writer recorded must match.
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    checkpoint.load_state_dict(back, tmp_path / "c", verify="full")
    plain = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    with pytest.warns(UserWarning):
        dcp.load(plain, checkpoint_id=tmp_path / "c", no_dist=True)
    dcp_to_torch_save(tmp_path / "c", tmp_path / "c.pt")
    flat = torch.load(tmp_path / "c.pt", weights_only=False)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            for got in (back[key], plain[key], flat[key]):
                assert torch.equal(got.contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), key
        else:
            assert back[key] == flat[key] == value
    data_file = tmp_path / "c" / "__0_0.distcp"
    assert read_manifest(tmp_path / "c").files["__0_0.distcp"].crc32 == zlib.crc32(data_file.read_bytes())
    assert data_file.stat().st_size < base.numel() * 4 + 4 * 1024 * 5  # the view's storage was not written whole


def test_reader_takes_whole_chunks_in_one_read_for_our_archives_and_falls_back_for_torch_save_ones(tmp_path):
    import pickle

    from checkpoint.reader import DirectReader
    from checkpoint.storage_backend import mount, unmount
    from tests.read_counting import ReadCountingStorage

    state = {"w": torch.randn(6, 5), "b": torch.arange(7, dtype=torch.bfloat16), "t": torch.tensor(2.0)}
    checkpoint.save_state_dict(state, tmp_path / "ours")
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True)  # torch.save archives
    for name in ("ours", "plain"):
        metadata = pickle.loads((tmp_path / name / ".metadata").read_bytes())
        back = {k: torch.full_like(v, 7) for k, v in state.items()}
        storage = ReadCountingStorage()
        mount(tmp_path, storage)
        try:
            with pytest.warns(UserWarning):
                dcp.load(back, storage_reader=DirectReader(tmp_path / name, metadata), no_dist=True)
        finally:
            unmount(tmp_path)
        for key, value in state.items():
            assert torch.equal(back[key], value), (name, key)
        if name == "ours":  # the three chunks lie back to back: one read of each byte, head to tail
            data_bytes = sum(f.stat().st_size for f in (tmp_path / name).glob("*.distcp"))
            assert (storage.data_reads(), storage.data_bytes()) == (1, data_bytes)
        else:  # the zip directory is parsed first
            assert storage.data_reads() > len(state)
    # A partial read (a reshard) takes the general path and gets the right rows.
    rows = torch.zeros(2, 5)
    checkpoint.load_state_dict({"w": checkpoint.shard(rows, (6, 5), offsets=(3, 0))}, tmp_path / "ours", strict=False)
    assert torch.equal(rows, state["w"][3:5])


def _counted_load(tmp_path, state, path, **kwargs):
    from checkpoint.storage_backend import mount, unmount
    from tests.read_counting import ReadCountingStorage

    storage = ReadCountingStorage()
    mount(tmp_path, storage)
    try:
        checkpoint.load_state_dict(state, path, **kwargs)
    finally:
        unmount(tmp_path)
    return storage


def test_small_chunks_lying_back_to_back_load_in_a_few_reads_each_byte_once(tmp_path):
    state = {f"t{i}": torch.randn(i % 7 + 1, 3) for i in range(300)}
    checkpoint.save_state_dict(state, tmp_path / "ck")
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    storage = _counted_load(tmp_path, back, tmp_path / "ck")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    data_bytes = sum(f.stat().st_size for f in (tmp_path / "ck").glob("*.distcp"))
    assert storage.data_bytes() == data_bytes
    assert storage.data_reads() <= 2  # one read per run of at most 340 chunks, not one per tensor


def test_archives_padded_as_earlier_releases_wrote_them_still_load_in_one_read_each_byte_once(tmp_path, monkeypatch):
    from checkpoint.chunk_archive import archive_layout

    state = {f"t{i}": torch.randn(i % 5 + 1, 3) for i in range(40)}
    with monkeypatch.context() as patched:  # the writer of earlier releases: every record's payload aligned
        patched.setattr(
            "checkpoint.data_file.plan_archive", lambda t: archive_layout(t.dtype, tuple(t.shape), padded=True)
        )
        checkpoint.save_state_dict(state, tmp_path / "old")
    checkpoint.save_state_dict(state, tmp_path / "new")
    sizes = {name: sum(f.stat().st_size for f in (tmp_path / name).glob("*.distcp")) for name in ("old", "new")}
    assert sizes["new"] < sizes["old"]
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    storage = _counted_load(tmp_path, back, tmp_path / "old")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    assert (storage.data_reads(), storage.data_bytes()) == (1, sizes["old"])  # no zip directory parsed


def test_a_damaged_archive_head_in_a_run_of_small_chunks_fails_the_load_naming_the_file(tmp_path):
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(20)}
    checkpoint.save_state_dict(state, tmp_path / "ck")
    (data_file,) = (tmp_path / "ck").glob("*.distcp")
    data = bytearray(data_file.read_bytes())
    heads = [i for i in range(len(data)) if data.startswith(b"archive/data.pkl", i)]
    data[heads[len(heads) // 2] + 3] ^= 0x01  # a record name in the head of a chunk in the middle of the run
    data_file.write_bytes(bytes(data))
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(checkpoint.CheckpointCorruptError, match=data_file.name):
        checkpoint.load_state_dict(back, tmp_path / "ck")


def test_two_keys_loaded_into_one_tensor_read_without_a_false_crc_failure(tmp_path):
    checkpoint.save_state_dict({"a": torch.full((8,), 1.0), "b": torch.full((8,), 2.0)}, tmp_path / "ck")
    shared = torch.zeros(8)
    checkpoint.load_state_dict({"a": shared, "b": shared}, tmp_path / "ck")
    assert torch.equal(shared, torch.full((8,), 1.0)) or torch.equal(shared, torch.full((8,), 2.0))


def test_a_conjugate_or_negative_view_loads_the_saved_values_not_its_raw_bytes(tmp_path):
    saved = torch.randn(6, dtype=torch.complex64)
    checkpoint.save_state_dict({"conj": saved, "neg": saved}, tmp_path / "ck")
    # Views that read their storage transformed (conjugated / negated): the bytes on disk cannot land in them raw.
    conj, neg = torch.zeros(6, dtype=torch.complex64).conj(), torch.zeros(6, dtype=torch.complex64)._neg_view()
    assert conj.is_conj() and neg.is_neg()
    checkpoint.load_state_dict({"conj": conj, "neg": neg}, tmp_path / "ck")
    assert torch.equal(conj, saved) and torch.equal(neg, saved)


def test_read_whole_tensors_fills_whole_stored_tensors_and_leaves_every_other_target_to_the_planner(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from checkpoint.reader import DirectReader

    state = {
        "w": torch.randn(6, 5),
        "b": torch.arange(7, dtype=torch.bfloat16),
        "t": torch.tensor(2.0),
        "v": torch.randn(3, 4),
        "big": torch.randn(64, 8),  # several chunks of 512 bytes
        "n": 3,
    }
    checkpoint.save_state_dict(state, tmp_path / "c", max_chunk_bytes=512)

    def read(path):
        opened = checkpoint.open_checkpoint(path)
        targets = {k: torch.full_like(v, 7) for k, v in state.items() if isinstance(v, torch.Tensor)}
        targets["v"] = torch.full((4, 3), 7.0)  # another shape than stored
        targets["n"] = torch.full((1,), 7)  # a stored non-tensor value
        targets["missing"] = torch.full((2,), 7.0)
        rest = DirectReader(opened.path, opened.metadata).read_whole_tensors(targets)
        return opened, targets, rest

    _, targets, rest = read(tmp_path / "c")
    assert set(rest) == {"v", "big", "n", "missing"}
    assert all(rest[k] is targets[k] and bool((rest[k] == 7).all()) for k in rest)  # left as they were
    for key in ("w", "b", "t"):
        assert torch.equal(targets[key], state[key]), key
    # a chunk that turns out not to be our archive once read: left to the planner's path (which parses the
    # zip directory: the damaged byte is outside the data it reads, so without CRC checks it loads exactly)
    opened, _, _ = read(tmp_path / "c")
    info = opened.metadata.storage_data[MetadataIndex("w", (0, 0))]
    data_file = tmp_path / "c" / info.relative_path
    blob = bytearray(data_file.read_bytes())
    blob[info.offset] ^= 0xFF  # the archive's first byte (its zip signature)
    data_file.write_bytes(bytes(blob))
    _, targets, rest = read(tmp_path / "c")
    assert "w" in rest and "b" not in rest and torch.equal(targets["b"], state["b"])
    back = {"w": torch.zeros(6, 5)}
    checkpoint.load_state_dict(back, tmp_path / "c", verify="sizes", strict=False)
    assert torch.equal(back["w"], state["w"])
    with pytest.raises(checkpoint.CheckpointCorruptError, match=info.relative_path):
        checkpoint.load_state_dict({"w": torch.zeros(6, 5)}, tmp_path / "c", strict=False)  # CRC-32 checked
