"""An async save in flight is not lost to the ways a training script ends (real processes, no sleeps).

Each save is held at a known point, in flight, by the test holding the path's write lock (as a second saver
would): the script's ending (destroying its process group, returning from a worker thread, SIGTERM) happens
while the save cannot have finished, and the test lets it go on only once the script has reached its ending.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.atomic import write_lock

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def _start(script: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _read_until(proc: subprocess.Popen, marker: str, seen: list[str]) -> bool:
    """Read ``proc``'s output into ``seen`` until a line holds ``marker``; False if it ended first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return True
    return False


def _finish(proc: subprocess.Popen, seen: list[str]) -> int:
    assert proc.stdout is not None
    seen.extend(proc.stdout)
    return proc.wait(timeout=TIMEOUT_S)


# One rank of a torchrun-style training script: env rendezvous, an async save, then the ending under test.
_RANK_SCRIPT = """
    import os, sys, torch, torch.distributed as dist
    import checkpoint
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # as torchrun sets them
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=world_size)
    checkpoint.async_save(os.environ["CKPT"], extra={f"rank{rank}": torch.full((64, 64), float(rank)), "step": 3})
    print(f"rank {rank} ending", flush=True)
    if os.environ["ENDING"] == "destroy":
        dist.destroy_process_group()
"""


@pytest.mark.parametrize("ending", ["destroy", "return"])
def test_an_async_save_in_flight_commits_whether_or_not_the_script_destroys_its_process_group(tmp_path, ending):
    path = tmp_path / "ck"
    seen: list[str] = []
    with write_lock(path):  # rank 0's writer waits here: the save is in flight when the script ends
        ranks = [
            _start(
                _RANK_SCRIPT, RANK=str(r), WORLD_SIZE="2", STORE=str(tmp_path / "store"), CKPT=str(path), ENDING=ending
            )
            for r in range(2)
        ]
        try:
            for r, proc in enumerate(ranks):
                assert _read_until(proc, f"rank {r} ending", seen), "".join(seen)
        except BaseException:
            for proc in ranks:
                proc.kill()
            raise
    codes = [_finish(proc, seen) for proc in ranks]
    assert codes == [0, 0], "".join(seen)
    back = checkpoint.load(path, verify="full")
    assert back["step"] == 3 and torch.equal(back["rank1"], torch.full((64, 64), 1.0)), "".join(seen)
    assert torch.equal(back["rank0"], torch.zeros(64, 64))
    assert "did not commit" not in "".join(seen)


def test_a_script_whose_process_group_is_destroyed_under_its_save_exits_1_naming_the_fix(tmp_path):
    # a reference to destroy_process_group taken before checkpoint is imported does not wait for the save
    script = _RANK_SCRIPT.replace(
        "import checkpoint", "from torch.distributed import destroy_process_group\n    import checkpoint"
    )
    script = script.replace(
        "dist.destroy_process_group()", "destroy_process_group()\n        print('destroyed', flush=True)"
    )
    path = tmp_path / "ck"
    seen: list[str] = []
    with write_lock(path):
        ranks = [
            _start(script, RANK=str(r), WORLD_SIZE="2", STORE=str(tmp_path / "store"), CKPT=str(path), ENDING="destroy")
            for r in range(2)
        ]
        try:
            for proc in ranks:  # destroyed under the save, which still waits for the lock
                assert _read_until(proc, "destroyed", seen), "".join(seen)
        except BaseException:
            for proc in ranks:
                proc.kill()
            raise
    codes = [_finish(proc, seen) for proc in ranks]
    out = "".join(seen)
    assert codes == [1, 1], out
    assert "did not commit" in out and "wait_for_async_save() before dist.destroy_process_group()" in out, out
    assert not path.exists()


def test_sigterm_during_an_async_save_finishes_it_then_terminates_by_sigterm(tmp_path):
    path = tmp_path / "ck"
    script = f"""
        import os, signal, threading, torch, checkpoint
        checkpoint.async_save({str(path)!r}, extra={{"w": torch.full((256, 256), 5.0), "step": 5}})
        print("in flight", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait()  # never reached past the handler: the process terminates
    """
    seen: list[str] = []
    with write_lock(path):
        proc = _start(script)
        try:
            assert _read_until(proc, "in flight", seen), "".join(seen)
            # SIGTERM arrived while the save waits for the lock this test holds
            assert _read_until(proc, "SIGTERM: finishing the async checkpoint save", seen), "".join(seen)
        except BaseException:
            proc.kill()
            raise
    code = _finish(proc, seen)
    assert code == -signal.SIGTERM, "".join(seen)
    back = checkpoint.load(path, verify="full")
    assert back["step"] == 5 and torch.equal(back["w"], torch.full((256, 256), 5.0))


def test_an_async_save_a_worker_thread_starts_as_the_main_thread_returns_commits(tmp_path):
    path = tmp_path / "ck"
    script = f"""
        import threading, torch, checkpoint
        started, exiting = threading.Event(), threading.Event()
        # The one point where the interpreter shows it is exiting: a threading exit hook. Registered after
        # checkpoint's, it runs just before it, once the main thread has returned (a private name: none is public).
        threading._register_atexit(exiting.set)

        class ExitGate:
            # a Stateful: its state_dict() runs inside async_save, which goes on only once the interpreter exits
            def state_dict(self):
                started.set()
                exiting.wait()
                return {{"v": 7}}

            def load_state_dict(self, state):
                pass

        def save():
            state = {{f"t{{i}}": torch.full((256, 256), float(i)) for i in range(8)}}
            checkpoint.async_save({str(path)!r}, extra={{"gate": ExitGate(), **state}})

        threading.Thread(target=save).start()
        started.wait()
        print("main returns", flush=True)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0 and done.stdout.strip() == "main returns", done.stderr
    back = checkpoint.load(path, verify="full")
    assert back["gate"] == {"v": 7} and torch.equal(back["t7"], torch.full((256, 256), 7.0)), done.stderr
