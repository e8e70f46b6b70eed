"""Sizes on the command line (``--max-shard-size 5GB``, ``--max-chunk-size 64MiB``) and the installed console script."""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.tool.cli import parse_size


@pytest.mark.parametrize(
    "text, size",
    [
        ("5GB", 5 * 1000**3),  # decimal, as transformers reads --max-shard-size
        ("500MB", 500 * 1000**2),
        ("3kb", 3000),
        ("1TB", 1000**4),
        ("2GiB", 2 * 1024**3),  # binary with the i
        ("64MiB", 64 * 1024**2),
        ("1KiB", 1024),
        ("1tib", 1024**4),
        ("100B", 100),
        ("100", 100),  # bare bytes
        ("1.5GB", 1_500_000_000),
        (" 2 MiB ", 2 * 1024**2),
    ],
)
def test_parse_size_reads_decimal_and_binary_units_case_insensitively(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "GB", "five GB", "-1GB", "1e3", "5 G B", ""])
def test_parse_size_rejects_what_is_not_a_size_with_examples_of_what_is(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"is not a size; write e\.g\. 5GB, 500MB or 2GiB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["0", "0GB", "0.1B"])
def test_parse_size_rejects_sizes_below_one_byte(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a positive size"):
        parse_size(text)


def test_the_installed_console_script_runs_and_reports_a_bad_size_in_one_line(tmp_path):
    exe = shutil.which("fsdp-ckpt")
    assert exe is not None, (
        "fsdp-ckpt is not on PATH: install the project with `pip install -e .` (scripts/setup_env.sh)"
    )
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "{inspect,verify,reshard,export,import,diff,gc}" in proc.stdout
    proc = subprocess.run(
        [exe, "export", str(tmp_path / "a"), str(tmp_path / "b"), "--format", "torch", "--max-shard-size", "5XB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fsdp-ckpt: error: argument --max-shard-size: '5XB' is not a size; write e.g. 5GB, 500MB or 2GiB; "
        "see `fsdp-ckpt export --help`"
    ]


def test_the_checkout_wrapper_runs_the_tool_from_any_directory_without_installing(tmp_path):
    # the README's way to reach fsdp-ckpt outside the quickstart's .venv
    script = Path(__file__).resolve().parents[1] / "scripts" / "fsdp_ckpt.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
    commands = proc.stdout.split("{", 1)[1].split("}", 1)[0].split(",")
    assert {"inspect", "verify", "reshard", "export", "import", "diff", "gc"} <= set(commands), proc.stdout
