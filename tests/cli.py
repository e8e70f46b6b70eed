"""The one place tests run ``fsdp-ckpt``.

In process (the default, through the ``cli`` fixture in conftest.py): ``main(argv)`` returns
the exit code and ``capsys`` holds what it printed, so a test costs no interpreter start.
As a real subprocess (:func:`run_subprocess`) only where the interpreter itself is under
test: the exit status of a closed pipe, ``--debug``'s traceback on stderr, ``-m`` entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.tool.cli import main

__all__ = ["run_in_process", "run_subprocess"]

REPO = Path(__file__).resolve().parents[1]


def _checked(proc: subprocess.CompletedProcess, check: int | None) -> subprocess.CompletedProcess:
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nstdout:{proc.stdout}\nstderr:{proc.stderr}"
    return proc


def run_in_process(capsys: pytest.CaptureFixture[str], *args, check: int | None = 0) -> subprocess.CompletedProcess:
    """``fsdp-ckpt ARGS`` via ``main``: exit code, stdout and stderr of this run only (``check``: expected code)."""
    argv = [str(a) for a in args]
    capsys.readouterr()  # drop what the test printed before: the result holds this run's output only
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors and --help, as the console script would exit
        code = exit_.code if isinstance(exit_.code, int) else 1
    out = capsys.readouterr()
    return _checked(subprocess.CompletedProcess(argv, code, out.out, out.err), check)


def run_subprocess(*args, check: int | None = 0, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m checkpoint.tool.cli ARGS`` in a fresh interpreter (for what only a real process shows).

    It imports this checkout, as the test process does, whatever is installed.
    """
    argv = [sys.executable, "-m", "checkpoint.tool.cli", *map(str, args)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return _checked(subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env), check)
