"""Every fsdp-ckpt failure exits non-zero with one line `fsdp-ckpt: error: <what>; <how to fix>`."""

import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint.manifest import KeyRecord, Manifest, checksum_file, write_manifest
from tests.cli import run_subprocess

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A committed checkpoint: plain dcp.save plus a manifest written the way the format does."""
    path = tmp_path_factory.mktemp("err") / "ck"
    sd = {"model.fc.weight": torch.randn(5, 4), "extra.step": 1}
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    files = {p.name: checksum_file(p) for p in path.iterdir()}
    keys = {"model.fc.weight": KeyRecord("tensor", "float32", (5, 4)), "extra.step": KeyRecord("bytes")}
    write_manifest(path, Manifest(world_size=1, keys=keys, files=files))
    return path


def _truncated_copy(ckpt, tmp_path, *, keep_manifest: bool):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    data = bad / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-40])
    if not keep_manifest:  # a plain DCP directory: the damage only shows when the chunk is read
        (bad / "manifest.json").unlink()
    return bad


CASES = {
    "missing path": (lambda ck, tmp: ["inspect", tmp / "nope"], 2, "does not exist"),
    "not a checkpoint": (lambda ck, tmp: ["verify", tmp], 2, "no .metadata"),
    "unknown format": (lambda ck, tmp: ["export", ck, tmp / "o", "--format", "onnx"], 2, "invalid choice"),
    "unknown command": (lambda ck, tmp: ["convert", ck], 2, "invalid choice"),
    "bad rename regex": (
        lambda ck, tmp: ["reshard", ck, tmp / "o", "--world-size", "2", "--rename", "(", "x"],
        2,
        "regex",
    ),
    "split that does not divide": (
        lambda ck, tmp: ["export", ck, tmp / "o", "--format", "torch", "--split", "fc.weight", "0", "a,b"],
        2,
        "not divisible",
    ),
    "bad size": (
        lambda ck, tmp: ["export", ck, tmp / "o", "--format", "safetensors", "--max-shard-size", "5XB"],
        2,
        "not a size",
    ),
    "zero ranks": (lambda ck, tmp: ["reshard", ck, tmp / "o", "--world-size", "0"], 2, "at least 1"),
    "output exists": (lambda ck, tmp: ["reshard", ck, ck.parent, "--world-size", "2"], 2, "--force"),
    "import of a missing file": (lambda ck, tmp: ["import", tmp / "w.safetensors", tmp / "o"], 2, "does not exist"),
    "import of a non-torch file": (lambda ck, tmp: ["import", ck / "manifest.json", tmp / "o"], 2, "weights_only"),
    "truncated file of a committed checkpoint": (
        lambda ck, tmp: ["export", _truncated_copy(ck, tmp, keep_manifest=True), tmp / "o.pt", "--format", "torch"],
        2,
        "fsdp-ckpt verify",
    ),
    "unreadable chunk of a plain DCP directory": (
        lambda ck, tmp: ["diff", _truncated_copy(ck, tmp, keep_manifest=False), ck],
        2,
        "fsdp-ckpt verify",
    ),
}


# This one runs as a real subprocess: the exit code a shell sees (argparse's usage errors get theirs
# through the installed console script in test_cli_sizes.py). The rest run in process (the cli
# fixture: the same code path minus ~3 s of interpreter start).
AS_SUBPROCESS = {"missing path"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_failure_exits_nonzero_with_one_error_line(case, ckpt, tmp_path, cli):
    make_args, code, fragment = CASES[case]
    args = make_args(ckpt, tmp_path)
    proc = run_subprocess(*args, check=None) if case in AS_SUBPROCESS else cli(*args, check=None)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("fsdp-ckpt: error: ") and ";" in lines[0], lines[0]
    assert fragment in lines[0]


def test_debug_shows_the_traceback(tmp_path):
    proc = run_subprocess("inspect", tmp_path / "nope", "--debug", check=None)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "FileNotFoundError" in proc.stderr


@pytest.mark.parametrize("command", ["inspect", "verify", "reshard", "export", "import", "diff"])
def test_help_of_every_command_has_examples(command, capsys):
    from checkpoint.tool.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "examples:" in out and f"fsdp-ckpt {command} " in out


def test_a_reader_closing_the_pipe_early_is_not_reported_as_an_error(ckpt):
    # `fsdp-ckpt inspect CKPT | head`: the pipe is gone before the output is written.
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkpoint.tool.cli", "inspect", str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert "error" not in stderr.lower() and "Traceback" not in stderr
