"""Hostile inputs: crafted checkpoint and import files never run code, never read outside, never hang.

Each payload is built on disk, then every ``fsdp-ckpt`` command (in process
through ``checkpoint.tool.cli.main``; two as real subprocesses) and every load API
is run against it. Each run must end as one clear error naming the damaged
file, or (for a command that never reads the crafted part, e.g. ``inspect`` of
a value) succeed; a payload's marker file must never appear, and nothing may
block on a FIFO or device. The outcome counts are printed.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from checkpoint.tool.cli import main as cli_main
from tests.bounded import run_bounded
from tests.cli import run_subprocess

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_TIMEOUT_S = 60


class _Payload:
    """Unpickling this writes ``marker``: the side effect every test checks is absent."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _good(root: Path) -> Path:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = root / "good"
    checkpoint.save(path, model=model, optimizer=opt, extra={"step": 3})
    return path


def _rewrite_manifest(ck: Path, edit=None) -> None:
    """Re-record every file's size and CRC-32 (the attacker controls the whole directory), then ``edit`` the JSON."""
    data = json.loads((ck / "manifest.json").read_text())
    for name in list(data["files"]):
        p = ck / name
        if p.is_file() and not p.is_symlink():
            raw = p.read_bytes()
            data["files"][name] = {"size": len(raw), "crc32": zlib.crc32(raw)}
    if edit is not None:
        edit(data)
    (ck / "manifest.json").write_text(json.dumps(data))


def _copy(good: Path, root: Path, name: str) -> Path:
    ck = root / name
    shutil.copytree(good, ck)
    return ck


# --------------------------------------------------------------------------- payload builders: (dir, file named in the error)


def metadata_payload(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    ck = _copy(good, root, "md_payload")
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rewrite_manifest(ck)
    return ck, ".metadata"


def metadata_payload_nested(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    """A valid Metadata with the payload hidden in planner_data."""
    ck = _copy(good, root, "md_nested")
    md = pickle.loads((ck / ".metadata").read_bytes())
    md.planner_data["x"] = _Payload(marker)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(ck)
    return ck, ".metadata"


def metadata_payload_plain(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    """A plain DCP directory (no manifest) whose .metadata is the payload."""
    ck = _copy(good, root, "md_plain")
    (ck / "manifest.json").unlink()
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    return ck, ".metadata"


def metadata_path_traversal(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    ck = _copy(good, root, "md_traversal")
    (root / "secret.distcp").write_bytes((ck / "__0_0.distcp").read_bytes())
    md = pickle.loads((ck / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../secret.distcp"
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(ck)
    return ck, ".metadata"


def manifest_checked_before_metadata(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    """A payload .metadata behind a malformed manifest: the manifest is read, and refused, first."""
    ck = _copy(good, root, "md_behind_bad_manifest")
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rewrite_manifest(ck, lambda d: d.update(world_size=-7))
    return ck, "manifest.json"


class _HugeBytearray:
    """Pickles as ``bytearray(2**32)``: a value of a few dozen bytes asking a load for 4 GiB (allocating nothing here)."""

    def __reduce__(self):
        return (bytearray, (1 << 32,))


def billion_laughs() -> tuple:
    """Nine levels of tuples of ten references to the level below: ~1.5 KB on disk, 10**9 elements to a walk.

    Tuples, not lists: saving walks lists of a state dict (looking for tensors and Stateful objects), DCP's
    own save too, so a list of lists like this one could not even be written.
    """
    laughs: tuple = (0,)
    for _ in range(9):
        laughs = (laughs,) * 10
    return laughs


def _value_payload(root: Path, marker: Path, name: str, committed: bool, value=None) -> tuple[Path, str]:
    ck = root / name
    value = _Payload(marker) if value is None else value
    # written by plain DCP: checkpoint.save refuses such a value
    dcp.save({"model.0.weight": torch.ones(3, 4), "extra.x": value}, checkpoint_id=str(ck), no_dist=True)
    if committed:
        from checkpoint.manifest import (
            KeyRecord,
            Manifest,
            checksum_file,
            write_manifest,
        )

        files = {p.name: checksum_file(p) for p in ck.iterdir()}
        keys = {"model.0.weight": KeyRecord("tensor", "float32", (3, 4)), "extra.x": KeyRecord("bytes")}
        write_manifest(ck, Manifest(world_size=1, keys=keys, files=files))
    return ck, "extra.x"


def value_payload(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    return _value_payload(root, marker, "value_payload", committed=True)


def value_payload_plain(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    return _value_payload(root, marker, "value_plain", committed=False)


def value_billion_laughs(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    return _value_payload(root, marker, "value_laughs", committed=True, value=billion_laughs())


def value_huge_bytearray(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
    return _value_payload(root, marker, "value_bytearray", committed=True, value=_HugeBytearray())


def _manifest_edit(name: str, edit, fragment: str = "manifest.json"):
    def build(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
        ck = _copy(good, root, name)
        _rewrite_manifest(ck, edit)
        return ck, fragment

    build.__name__ = name
    return build


def _relist(data: dict, new_name: str) -> None:
    data["files"][new_name] = data["files"].pop("__0_0.distcp")


def _raw_manifest(name: str, raw: bytes):
    def build(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
        ck = _copy(good, root, name)
        (ck / "manifest.json").write_bytes(raw)
        return ck, "manifest.json"

    build.__name__ = name
    return build


def _special_data_file(name: str, make):
    """``__0_0.distcp`` replaced by a FIFO / a link to a device; the manifest still lists it."""

    def build(good: Path, root: Path, marker: Path) -> tuple[Path, str]:
        ck = _copy(good, root, name)
        (ck / "__0_0.distcp").unlink()
        make(ck / "__0_0.distcp")
        return ck, "__0_0.distcp"

    build.__name__ = name
    return build


def _abs_secret(data: dict) -> None:
    secret = "/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd"
    data["files"][secret] = data["files"].pop("__0_0.distcp")


CHECKPOINT_PAYLOADS = [
    metadata_payload,
    metadata_payload_nested,
    metadata_payload_plain,
    metadata_path_traversal,
    manifest_checked_before_metadata,
    value_payload,
    value_payload_plain,
    value_billion_laughs,
    value_huge_bytearray,
    _manifest_edit("manifest_dotdot", lambda d: _relist(d, "../secret.txt")),
    _manifest_edit("manifest_absolute", _abs_secret),
    _manifest_edit("manifest_subdir", lambda d: _relist(d, "sub/x.distcp")),
    _manifest_edit("manifest_world_size_negative", lambda d: d.update(world_size=-7)),
    _manifest_edit("manifest_world_size_bool", lambda d: d.update(world_size=True)),
    _manifest_edit("manifest_size_negative", lambda d: d["files"]["__0_0.distcp"].update(size=-1)),
    _manifest_edit("manifest_size_absurd", lambda d: d["files"]["__0_0.distcp"].update(size=10**30)),
    _manifest_edit("manifest_files_list", lambda d: d.update(files=[1, 2])),
    _manifest_edit("manifest_keys_list", lambda d: d.update(keys=[["a", "b"]])),
    _manifest_edit("manifest_unlists_data", lambda d: d["files"].pop("__0_0.distcp"), ".metadata"),
    _raw_manifest("manifest_json_list", b"[1, 2, 3]"),
    _raw_manifest(
        "manifest_world_size_1e400",
        b'{"format": "fsdp_dtensor", "version": 1, "world_size": 1e400, "keys": {}, "files": {}}',
    ),
    _raw_manifest("manifest_huge_int", b'{"format": "fsdp_dtensor", "version": 1, "world_size": ' + b"9" * 5000 + b"}"),
    _raw_manifest("manifest_bad_utf8", b'{"format": "\xff\xfe"}'),
    _raw_manifest("manifest_deep_nesting", b"[" * 200_000 + b"]" * 200_000),
    _raw_manifest("manifest_empty", b""),
    _special_data_file("data_fifo", os.mkfifo),
    _special_data_file("data_dev_zero", lambda p: os.symlink("/dev/zero", p)),
    _special_data_file("data_dev_urandom", lambda p: os.symlink("/dev/urandom", p)),
]


def _cli_runs(ck: Path, good: Path, out: Path) -> dict[str, list[str]]:
    return {
        "inspect": ["inspect", str(ck)],
        "verify": ["verify", str(ck)],
        "reshard": ["reshard", str(ck), str(out / "reshard"), "--world-size", "2", "-q"],
        "export-safetensors": ["export", str(ck), str(out / "hf"), "--format", "safetensors", "-q"],
        "export-torch": ["export", str(ck), str(out / "full.pt"), "--format", "torch", "-q"],
        "diff": ["diff", str(ck), str(good), "-q"],
        "diff (hostile second)": ["diff", str(good), str(ck), "-q"],
    }


def _api_runs(ck: Path) -> dict:
    def load_full():
        model = _model()
        return checkpoint.load(ck, model=model, optimizer=torch.optim.AdamW(model.parameters()), strict=False)

    return {
        "load": lambda: checkpoint.load(ck, model=_model(), strict=False),
        "load+optimizer": load_full,
        "load(require_manifest=False)": lambda: checkpoint.load(
            ck, model=_model(), strict=False, require_manifest=False
        ),
        "load(verify='full')": lambda: checkpoint.load(ck, model=_model(), strict=False, verify="full"),
        "load(verify='none', require_manifest=False)": lambda: checkpoint.load(
            ck, model=_model(), strict=False, verify="none", require_manifest=False
        ),
        "load_state_dict": lambda: checkpoint.load_state_dict(
            {"extra": {"x": None, "step": None}}, ck, strict=False, require_manifest=False
        ),
    }


def _bounded(fn):
    """``fn()`` on a thread; (returned, raised), or a test failure when it blocks (a FIFO / device read)."""
    hung, value, exc = run_bounded(fn, _TIMEOUT_S)
    assert not hung, f"{fn} hung for {_TIMEOUT_S} s"
    return value, exc


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return _good(tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize("build", CHECKPOINT_PAYLOADS, ids=lambda b: b.__name__)
def test_a_crafted_checkpoint_is_refused_naming_the_file_with_nothing_run(build, good, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    ck, fragment = build(good, tmp_path, marker)
    outcomes: Counter = Counter()
    for name, argv in _cli_runs(ck, good, tmp_path / "out").items():
        code, exc = _bounded(lambda argv=argv: cli_main(argv))
        captured = capsys.readouterr()
        assert exc is None, f"{name}: raised {exc!r}"
        lines = captured.err.strip().splitlines()
        if code == 0:
            outcomes["cli ok"] += 1
            # only inspect, which reads no value and no data file, may succeed, and only when those are the crafted part
            assert fragment in ("extra.x", "__0_0.distcp") and name == "inspect", (
                f"{name} accepted {ck}: {captured.out[-300:]}"
            )
        else:
            outcomes["cli refused"] += 1
            assert len(lines) == 1 and lines[0].startswith("fsdp-ckpt: error: "), f"{name}: {captured.err}"
            # verify lists each problem on stdout (PROBLEM <file>: ...) and sums them up in the error line
            named = lines[0] + (captured.out if name == "verify" else "")
            assert fragment in named or (fragment == "extra.x" and str(ck) in named), f"{name}: {lines[0]}"
        assert not marker.exists(), f"{name} ran the payload"
    for name, fn in _api_runs(ck).items():
        _, exc = _bounded(fn)
        assert not marker.exists(), f"{name} ran the payload"
        assert exc is not None, f"{name} loaded {ck} without an error"
        assert isinstance(exc, (ValueError, OSError)), f"{name}: {type(exc).__name__}: {exc}"
        assert fragment in str(exc) or str(ck) in str(exc), f"{name}: {exc}"
        outcomes["api refused"] += 1
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    print(f"\n{build.__name__}: {dict(outcomes)}, payload run 0 times")


def test_save_refuses_a_value_weights_only_loading_cannot_read_back(tmp_path):
    marker = tmp_path / "MARKER"
    with pytest.raises(ValueError, match=r"'extra\.x'.*weights_only"):
        checkpoint.save(tmp_path / "c", model=_model(), extra={"x": _Payload(marker)})
    with pytest.raises(ValueError, match=r"'extra\.x'.*weights_only"):
        checkpoint.async_save(tmp_path / "c", model=_model(), extra={"x": _Payload(marker)})
    assert not marker.exists() and not (tmp_path / "c").exists() and not (tmp_path / "c.tmp").exists()
    # plain values still save and load back
    checkpoint.save(tmp_path / "c", model=_model(), extra={"x": {"lr": [1e-3, (0.9, 0.99)], "name": "run", "n": None}})
    assert checkpoint.load(tmp_path / "c", model=_model())["x"] == {"lr": [1e-3, (0.9, 0.99)], "name": "run", "n": None}


# --------------------------------------------------------------------------- import sources


def _safetensors(path: Path, edit_header=None, raw_header: bytes | None = None) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0)}, str(path))
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    if edit_header is not None:
        edit_header(header)
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def _index(directory: Path, weight_map: dict) -> Path:
    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def import_traversal(root: Path, marker: Path):
    _safetensors(root / "outside.safetensors")
    return _index(root / "hf", {"w": "../outside.safetensors"}), "../outside.safetensors"


def import_absolute(root: Path, marker: Path):
    _safetensors(root / "outside.safetensors")
    return _index(root / "hf", {"w": str(root / "outside.safetensors")}), "outside.safetensors"


def import_offsets_out_of_range(root: Path, marker: Path):
    path = root / "bad.safetensors"
    _safetensors(path, lambda h: h["w"].update(data_offsets=[0, 1 << 40]))
    return path, "bad.safetensors"


def import_header_too_large(root: Path, marker: Path):
    path = root / "big.safetensors"
    _safetensors(path)
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 60) + raw[8:])
    return path, "big.safetensors"


def import_header_not_json(root: Path, marker: Path):
    path = root / "junk.safetensors"
    _safetensors(path, raw_header=b"\xff" * 16)
    return path, "junk.safetensors"


def import_torch_payload(root: Path, marker: Path):
    path = root / "weights.pt"
    torch.save({"w": torch.ones(2), "x": _Payload(marker)}, path)
    return path, "weights.pt"


def import_fifo(root: Path, marker: Path):
    path = root / "fifo.safetensors"
    os.mkfifo(path)
    return path, "fifo.safetensors"


def import_index_fifo(root: Path, marker: Path):
    directory = root / "hf"
    directory.mkdir()
    os.mkfifo(directory / "model.safetensors.index.json")
    return directory, "model.safetensors.index.json"


def import_link_to_device(root: Path, marker: Path):
    path = root / "zero.safetensors"
    os.symlink("/dev/zero", path)
    return path, "zero.safetensors"


IMPORT_PAYLOADS = [
    import_link_to_device,
    import_traversal,
    import_absolute,
    import_offsets_out_of_range,
    import_header_too_large,
    import_header_not_json,
    import_torch_payload,
    import_fifo,
    import_index_fifo,
]


@pytest.mark.parametrize("build", IMPORT_PAYLOADS, ids=lambda b: b.__name__)
def test_a_crafted_import_source_is_refused_naming_the_file(build, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    src, fragment = build(tmp_path, marker)
    code, exc = _bounded(lambda: cli_main(["import", str(src), str(tmp_path / "out"), "-q"]))
    err = capsys.readouterr().err.strip()
    assert exc is None and code == 2, err
    assert err.startswith("fsdp-ckpt: error: ") and len(err.splitlines()) == 1 and fragment in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()
    print(f"\n{build.__name__}: refused: {err[:160]}")


def test_import_follows_links_to_regular_files_as_in_the_hugging_face_cache(tmp_path):
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    _safetensors(blob)
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blob)
    assert cli_main(["import", str(snapshot), str(tmp_path / "out"), "-q"]) == 0
    state = {"model": {"w": torch.zeros(4)}}
    checkpoint.load_state_dict(state, tmp_path / "out")
    assert torch.equal(state["model"]["w"], torch.arange(4.0))


# --------------------------------------------------------------------------- real processes: exit codes


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_subprocess(*args, check=None, timeout=_TIMEOUT_S)


def test_the_cli_process_exits_2_on_a_metadata_payload_and_on_a_fifo(good, tmp_path):
    marker = tmp_path / "MARKER"
    ck, _ = metadata_payload(good, tmp_path, marker)
    proc = _cli("export", str(ck), str(tmp_path / "o.pt"), "--format", "torch")
    assert proc.returncode == 2 and ".metadata" in proc.stderr and not marker.exists(), proc.stderr
    fifo, _ = _special_data_file("data_fifo", os.mkfifo)(good, tmp_path, marker)
    proc = _cli("verify", str(fifo))
    assert proc.returncode in (1, 2) and "FIFO" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("build", [value_billion_laughs, value_huge_bytearray], ids=lambda b: b.__name__)
def test_a_value_that_would_cost_more_than_its_file_is_refused_by_a_load_within_a_counted_budget(build, tmp_path):
    from tests.bounded import WorkBudgetExceeded, run_counted

    ck, _ = build(None, tmp_path, tmp_path / "MARKER")
    _, raised, lines, peak = run_counted(
        lambda: checkpoint.load_state_dict({"extra": {"x": None}}, ck, strict=False),
        max_lines=1_000_000,
        max_bytes=64 << 20,
    )
    print(f"{lines} Python lines, {peak} bytes at peak")
    assert not isinstance(raised, WorkBudgetExceeded), f"{raised} ({lines} lines, {peak} bytes at peak)"
    assert isinstance(raised, checkpoint.CheckpointCorruptError) and "extra.x" in str(raised), raised


@pytest.mark.parametrize("value", [billion_laughs(), _HugeBytearray()], ids=["billion laughs", "bytearray(2**32)"])
def test_save_refuses_a_value_a_load_would_refuse_as_too_costly(tmp_path, value):
    with pytest.raises(ValueError, match=r"'extra\.x'.*a load would refuse"):
        checkpoint.save(tmp_path / "ck", extra={"x": value})
    assert not (tmp_path / "ck").exists()
