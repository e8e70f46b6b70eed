"""The compiled host step is built once per machine, whoever starts first, and can be built ahead of time."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from offload_fsdp import compiled_step

PROCESSES = 3


def _start_together(barrier, cache: str, log: str) -> None:
    """One process of a fresh node: all start at the barrier and need the library."""
    os.environ["OFFLOAD_FSDP_CACHE_DIR"] = cache

    def fake_compile(compiler: str, out: Path) -> None:  # a slow build, so that without a lock they would overlap
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        out.write_bytes(b"library")

    compiled_step._compile = fake_compile
    path = Path(cache) / "host_adam-test.so"
    barrier.wait()
    compiled_step._ensure_built("cc", path)
    assert path.read_bytes() == b"library"


def test_processes_starting_at_once_build_once_and_all_find_the_library(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the children only touch files: fork is safe and fast
    barrier = ctx.Barrier(PROCESSES)
    log = tmp_path / "builds.log"
    procs = [ctx.Process(target=_start_together, args=(barrier, str(tmp_path / "cache"), str(log)))
             for _ in range(PROCESSES)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    assert len(log.read_text().split()) == 1, "one build for all processes"


def test_a_build_is_announced_once_at_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(compiled_step, "_compile", lambda compiler, out: out.write_bytes(b"library"))
    path = tmp_path / "host_adam-test.so"
    with caplog.at_level("WARNING", logger="offload_fsdp.compiled_step"):
        assert compiled_step._ensure_built("cc", path)
        assert not compiled_step._ensure_built("cc", path)  # already there: loaded, not built
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "building the host Adam step once for this machine" in messages[0]
    assert "python -m offload_fsdp.compiled_step --build" in messages[0]


def _build_command(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload_fsdp.compiled_step", "--build"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_the_build_command_exits_nonzero_with_one_line_reason_without_a_compiler(tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "OFFLOAD_FSDP_CACHE_DIR": str(tmp_path)}
    proc = _build_command(env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the compiled host step could not be built")


def test_the_build_command_builds_into_the_cache_the_optimizer_loads_from():
    proc = _build_command(dict(os.environ))  # the user's cache: a second run (and the fast-path tests) only load
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout.startswith("compiled host step ready: ")
        and Path(proc.stdout.split(": ")[1].split(" (")[0]).exists()
    )


def test_a_private_build_for_an_unwritable_cache_is_announced_with_the_fix(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("OFFLOAD_FSDP_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot be created
    monkeypatch.setenv("CC", sys.executable)  # any program that exists and answers --version
    built: list[Path] = []

    def fake_compile(compiler: str, out: Path) -> None:
        built.append(out)
        raise RuntimeError("stop after the build starts")

    monkeypatch.setattr(compiled_step, "_compile", fake_compile)
    with caplog.at_level("WARNING", logger="offload_fsdp.compiled_step"), pytest.raises(RuntimeError, match="stop"):
        compiled_step._compile_and_load()
    assert len(built) == 1 and blocker not in built[0].parents, "a private build, outside the cache"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "for this process only" in messages[0], messages
    assert "OFFLOAD_FSDP_CACHE_DIR" in messages[0] and str(blocker / "cache") in messages[0]


def test_a_builder_killed_with_sigkill_leaves_no_lock_behind(tmp_path):
    lock = tmp_path / "host_adam-test.so.lock"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the builder: takes the lock, says so, and is killed holding it
        with compiled_step._exclusive(lock):
            os.write(ready_w, b"x")
            signal.pause()
        os._exit(0)
    os.read(ready_r, 1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)

    def take() -> None:
        with compiled_step._exclusive(lock):
            pass

    taker = threading.Thread(target=take, daemon=True)  # a stale lock would block it: fail, never hang
    taker.start()
    taker.join(60)
    assert not taker.is_alive(), "the lock outlived the killed builder"
