"""The streaming safetensors writer behind `fsdp-ckpt export` (checkpoint/safetensors_io.py), in process."""

import pytest
import torch

from checkpoint.tool.safetensors_io import write_shards

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_shards_read_back_with_the_safetensors_library_for_bool_empty_and_strided_tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {
        "model.mask": torch.tensor([[True, False, True], [False, False, True]]),
        "model.empty": torch.zeros(0, 3),
        "model.column": torch.randn(4, 3, generator=g).bfloat16()[:, 1],  # a strided view
        "model.w": torch.randn(3, 5, generator=g),
    }
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in values.items()]
    shards = [specs[:2], specs[2:]]
    write_shards(tmp_path, shards, iter(values.items()), full_keys=True)
    back = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        back |= safetensors_torch.load_file(path)
    assert back.keys() == values.keys()
    for key, value in values.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def _export(src, dst, *extra) -> int:
    from checkpoint.tool.cli import main

    return main(
        [
            "export",
            str(src),
            str(dst),
            "--format",
            "safetensors",
            "--model-only",
            "-q",
            "--max-shard-size",
            "16B",
            *extra,
        ]
    )  # one tensor per shard


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _fail_after_first_shard(monkeypatch) -> None:
    """The writer raises as it starts the second shard's tensor (the first shard is complete on disk)."""
    import checkpoint.tool.safetensors_io as io

    real, calls = io.tensor_bytes, []

    def tensor_bytes(tensor):
        calls.append(tensor.shape)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(tensor)

    monkeypatch.setattr(io, "tensor_bytes", tensor_bytes)


def test_an_export_failing_mid_way_leaves_no_output_or_the_previous_export_whole(tmp_path, monkeypatch, capsys):
    import checkpoint
    from checkpoint.atomic import old_path, staging_path

    first = {"model.a": torch.arange(4.0), "model.b": torch.ones(3), "model.c": torch.zeros(2)}
    second = {k: v + 10 for k, v in first.items()}
    checkpoint.save_state_dict(first, tmp_path / "first")
    checkpoint.save_state_dict(second, tmp_path / "second")
    dst = tmp_path / "hf"

    with monkeypatch.context() as m:
        _fail_after_first_shard(m)
        assert _export(tmp_path / "first", dst) == 2
    assert "disk full" in capsys.readouterr().err
    assert not dst.exists() and not staging_path(dst).exists()  # no output at all, no leftovers

    assert _export(tmp_path / "first", dst) == 0
    (dst / "config.json").write_text("{}")  # a file of the user's beside the export
    before = _files(dst)
    assert len([n for n in before if n.endswith(".safetensors")]) == 3
    with monkeypatch.context() as m:
        _fail_after_first_shard(m)
        assert _export(tmp_path / "second", dst, "--force") == 2
    assert _files(dst) == before  # the previous export, byte for byte

    assert _export(tmp_path / "second", dst, "--force") == 0
    got = {}
    for path in dst.glob("*.safetensors"):
        got |= safetensors_torch.load_file(path)
    assert got.keys() == {"a", "b", "c"} and all(torch.equal(got[k], second[f"model.{k}"]) for k in got)
    assert (dst / "config.json").read_text() == "{}"  # carried over by the swap
    assert not staging_path(dst).exists() and not old_path(dst).exists()


def _hf_dir_with_a_stale_shard(directory, weight_map: dict) -> None:
    """``w`` and ``v`` as the index maps them, plus a stale ``w`` in b.safetensors (an earlier export's)."""
    import json

    directory.mkdir()
    safetensors_torch.save_file({"w": torch.ones(2, 3)}, directory / "a.safetensors")
    safetensors_torch.save_file({"v": torch.full((4,), 2.0), "w": torch.zeros(2, 3)}, directory / "b.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_import_takes_each_tensor_from_the_file_the_index_names_and_ignores_a_stale_one(cli, tmp_path, caplog):
    import checkpoint

    _hf_dir_with_a_stale_shard(tmp_path / "hf", {"w": "a.safetensors", "v": "b.safetensors"})
    with caplog.at_level("WARNING", logger="checkpoint.tool.safetensors_io"):
        cli("import", tmp_path / "hf", tmp_path / "ck")
    assert "ignoring 1 tensor(s)" in caplog.text and "b.safetensors" in caplog.text and "(w)" in caplog.text
    got = {"model": {"w": torch.full((2, 3), -1.0), "v": torch.zeros(4)}}
    checkpoint.load_state_dict(got, tmp_path / "ck", no_dist=True)
    assert torch.equal(got["model"]["w"], torch.ones(2, 3))  # a.safetensors', as the index says
    assert torch.equal(got["model"]["v"], torch.full((4,), 2.0))


def test_import_refuses_an_index_naming_a_tensor_its_file_lacks(cli, tmp_path):
    _hf_dir_with_a_stale_shard(tmp_path / "hf", {"w": "a.safetensors", "v": "a.safetensors"})
    out = cli("import", tmp_path / "hf", tmp_path / "ck", check=2)
    assert "names tensors its files do not hold ('v' in a.safetensors)" in out.stderr, out.stderr
    assert not (tmp_path / "ck").exists()
