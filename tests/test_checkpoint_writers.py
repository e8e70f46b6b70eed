"""One writer per path, failures that surface, and saves that never delete what they did not write."""

import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import checkpoint
import checkpoint.storage
from checkpoint.atomic import MARKER_NAME, staging_path
from tests.distributed import PROCESSES

REPO = Path(__file__).resolve().parents[1]
TRIALS = 10


def _state(v: int) -> dict:
    # several tensors and files' worth of work, so two racing saves overlap
    return {"w": {f"t{i}": torch.full((64, 64), float(v)) for i in range(8)}, "v": v}


def _which_state(path) -> int:
    """The one state the checkpoint at ``path`` holds, read with full verification; fails on a mix."""
    back = {"w": {f"t{i}": torch.full((64, 64), -1.0) for i in range(8)}, "v": None}
    checkpoint.load_state_dict(back, path, verify="full")
    v = back["v"]
    assert all(torch.equal(t, torch.full((64, 64), float(v))) for t in back["w"].values()), f"a mix of states at v={v}"
    return v


def _racer(path: str, first_value: int, barrier, trials: int) -> None:
    torch.set_num_threads(1)
    for trial in range(trials):
        barrier.wait()  # both processes start each save together
        checkpoint.save_state_dict(_state(first_value + 2 * trial), path)
        barrier.wait()  # both saves of this trial are over: the test reads the result before the next trial


def test_two_processes_saving_to_one_path_commit_one_whole_state_each_time(tmp_path):
    ctx = PROCESSES  # forked from a server that imported torch once (tests/distributed.py)
    barrier = ctx.Barrier(3)
    path = str(tmp_path / "ck")
    procs = [ctx.Process(target=_racer, args=(path, first, barrier, TRIALS)) for first in (0, 1)]
    for p in procs:
        p.start()
    outcomes = []
    try:
        for trial in range(TRIALS):
            barrier.wait(timeout=120)  # releases both racers for this trial
            barrier.wait(timeout=120)  # both racers' saves returned; none starts again until the next trial
            outcomes.append(_which_state(path) - 2 * trial)
        for p in procs:
            p.join(timeout=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    print(f"{TRIALS} races: last writer was process 0 in {outcomes.count(0)}, process 1 in {outcomes.count(1)}")
    assert sorted(set(outcomes)) <= [0, 1]  # every trial ended as one whole state of that trial
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging, swap dir or lock file left


@pytest.fixture
def slow_writer(monkeypatch):
    """Each tensor's write waits for ``release``, so an async save is still in flight when the next call comes."""
    release = threading.Event()
    original = checkpoint.storage.write_tensor

    def held(stream, tensor):
        release.wait(timeout=60)
        original(stream, tensor)

    monkeypatch.setattr(checkpoint.storage, "write_tensor", held)
    yield release
    release.set()


def test_a_blocking_save_after_an_async_one_to_the_same_path_commits_after_it(tmp_path, slow_writer):
    from checkpoint.async_save import async_save_state_dict

    path = tmp_path / "ck"
    future = async_save_state_dict(_state(1), path)
    threading.Timer(0.05, slow_writer.set).start()  # lets the async save go on while the blocking one waits
    checkpoint.save_state_dict(_state(2), path)
    assert future.done() and future.result() is None
    assert _which_state(path) == 2


def test_two_async_saves_to_the_same_path_commit_in_call_order(tmp_path, slow_writer):
    from checkpoint.async_save import async_save_state_dict

    path = tmp_path / "ck"
    first = async_save_state_dict(_state(1), path)
    threading.Timer(0.05, slow_writer.set).start()
    second = async_save_state_dict(_state(2), path)
    assert first.result(timeout=60) is None and second.result(timeout=60) is None
    assert _which_state(path) == 2


def _fail_writes(monkeypatch) -> None:
    def broken(stream, tensor):
        raise OSError(errno.EIO, "injected write failure")

    monkeypatch.setattr(checkpoint.storage, "write_tensor", broken)


def test_a_failed_async_save_is_logged_when_it_happens_and_raised_by_the_next_save(tmp_path, monkeypatch, caplog):
    from checkpoint.async_save import async_save_state_dict

    with monkeypatch.context() as m:
        _fail_writes(m)
        with caplog.at_level(logging.ERROR, logger="checkpoint.async_save"):
            async_save_state_dict(_state(1), tmp_path / "a")  # the caller never looks at the future
            with pytest.raises(checkpoint.AsyncSaveError, match="injected write failure") as raised:
                checkpoint.wait_for_async_save()
    assert any("injected write failure" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert isinstance(raised.value.__cause__, OSError)
    assert not (tmp_path / "a").exists() and not staging_path(tmp_path / "a").exists()

    with monkeypatch.context() as m:
        _fail_writes(m)
        async_save_state_dict(_state(1), tmp_path / "b")
        with pytest.raises(checkpoint.AsyncSaveError, match=r"async checkpoint save to .*'.*b'"):
            checkpoint.save_state_dict(_state(2), tmp_path / "c")  # the next save raises it, before saving
    assert not (tmp_path / "c").exists()
    checkpoint.save_state_dict(_state(3), tmp_path / "c")  # raised once: the save after it goes ahead
    assert _which_state(tmp_path / "c") == 3


def test_a_failed_async_save_whose_future_was_asked_is_not_raised_again(tmp_path, monkeypatch):
    from checkpoint.async_save import async_save_state_dict

    with monkeypatch.context() as m:
        _fail_writes(m)
        future = async_save_state_dict(_state(1), tmp_path / "a")
        with pytest.raises(OSError, match="injected"):
            future.result(timeout=60)
    checkpoint.save_state_dict(_state(2), tmp_path / "b")
    assert _which_state(tmp_path / "b") == 2


def test_a_process_exiting_with_an_async_save_in_flight_finishes_it(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch, checkpoint
        state = {{"w": {{f"t{{i}}": torch.full((256, 256), 7.0) for i in range(16)}}, "v": 7}}
        checkpoint.async_save({str(tmp_path / "ck")!r}, extra=state)
        # exits here without waiting on the future
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "cannot schedule new futures" not in done.stderr
    back = checkpoint.load(tmp_path / "ck", verify="full")
    assert back["v"] == 7 and torch.equal(back["w"]["t15"], torch.full((256, 256), 7.0))


def test_a_save_never_touches_the_users_backups_beside_the_checkpoint(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1), path)
    os.replace(path, tmp_path / "ck.old")  # the user's backup: `mv ck ck.old`
    (tmp_path / "ck.old" / "notes.txt").write_text("mine")
    (tmp_path / "ck.tmp").mkdir()
    (tmp_path / "ck.tmp" / "notes.txt").write_text("mine too")
    for v in (2, 3):
        checkpoint.save_state_dict(_state(v), path)
    assert _which_state(path) == 3
    assert (tmp_path / "ck.old" / "notes.txt").read_text() == "mine"
    assert _which_state(tmp_path / "ck.old") == 1
    assert (tmp_path / "ck.tmp" / "notes.txt").read_text() == "mine too"
    assert not (path / MARKER_NAME).exists()  # a committed checkpoint holds only its own files


def test_an_unmarked_directory_at_the_staging_name_is_left_alone_and_named_in_the_error(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1), path)
    squatter = staging_path(path)
    squatter.mkdir()
    (squatter / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="in the way") as raised:
        checkpoint.save_state_dict(_state(2), path)
    assert str(squatter) in str(raised.value)
    assert (squatter / "notes.txt").read_text() == "mine"
    assert _which_state(path) == 1


def test_a_target_that_is_not_a_checkpoint_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    written = []
    original = checkpoint.storage.write_tensor
    monkeypatch.setattr(checkpoint.storage, "write_tensor", lambda s, t: (written.append(1), original(s, t)))
    target = tmp_path / "data"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for bad in (target, tmp_path / "file"):
        with pytest.raises(FileExistsError, match="move it away") as raised:
            checkpoint.save_state_dict(_state(1), bad)
        assert isinstance(raised.value, Exception) and str(bad) in str(raised.value)
        assert not staging_path(bad).exists()
    assert written == [] and (target / "notes.txt").read_text() == "mine"


def test_an_export_with_force_never_touches_the_users_dir_beside_the_output(tmp_path):
    from checkpoint.tool.cli import main

    checkpoint.save_state_dict({"model": {"a": torch.arange(4.0)}}, tmp_path / "ck")
    dst = tmp_path / "hf"
    (tmp_path / "hf.old").mkdir()
    (tmp_path / "hf.old" / "notes.txt").write_text("mine")
    for _ in range(2):
        assert main(["export", str(tmp_path / "ck"), str(dst), "--format", "safetensors", "-q", "--force"]) == 0
    assert (tmp_path / "hf.old" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in dst.iterdir()) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]


def test_a_disk_full_error_names_the_file_removes_the_staging_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1), path)
    real_fsync = os.fsync

    def full(fd):  # where a file system reports that the data did not fit
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(checkpoint.DiskFullError, match=r"no space left .*\.distcp") as raised:
        checkpoint.save_state_dict(_state(2), path)
    monkeypatch.undo()
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.ENOSPC
    assert not staging_path(path).exists()
    assert _which_state(path) == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs: a real full disk. Skipped where mounting is not permitted."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_saves_and_exports_onto_a_full_disk_fail_clearly_and_leave_no_staging(tmp_path, small_tmpfs, capsys):
    big = {"model": {f"t{i}": torch.ones(256, 256) for i in range(12)}}  # 3 MiB: does not fit
    path = small_tmpfs / "ck"
    checkpoint.save_state_dict({"model": {"t0": torch.ones(4)}}, path)
    with pytest.raises(checkpoint.DiskFullError, match="no space left"):
        checkpoint.save_state_dict(big, path)
    assert not staging_path(path).exists()
    back = {"model": {"t0": torch.zeros(4)}}
    checkpoint.load_state_dict(back, path, verify="full")  # the previous checkpoint survived
    assert torch.equal(back["model"]["t0"], torch.ones(4))

    checkpoint.save_state_dict(big, tmp_path / "big")
    # torch export writes through a memory map: in a subprocess, so a SIGBUS would show as its exit code
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "checkpoint.tool.cli",
            "export",
            str(tmp_path / "big"),
            str(small_tmpfs / "model.pt"),
            "--format",
            "torch",
            "-q",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode not in (0, -7), done.stderr  # -7: killed by SIGBUS
    assert "no space left" in done.stderr, done.stderr
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["ck"]
    from checkpoint.tool.cli import main

    for command, *options, out in (["export", "--format", "safetensors", "hf"], ["reshard", "--world-size", "2", "re"]):
        assert main([command, str(tmp_path / "big"), str(small_tmpfs / out), *options, "-q"]) != 0
        assert "no space left" in capsys.readouterr().err
        assert sorted(p.name for p in small_tmpfs.iterdir()) == ["ck"]


def test_a_process_exiting_after_an_unobserved_async_save_failure_says_so_and_exits_1(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("mine")  # user data: the save is refused in the background
    script = textwrap.dedent(
        f"""
        from concurrent.futures import wait
        import torch, checkpoint
        future = checkpoint.async_save({str(tmp_path / "ck")!r}, extra={{"w": torch.ones(4)}})
        wait([future])  # done, and failed, but nobody asked the future: the process exits 0 after this
        print("training finished")
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "training finished", done.stderr
    assert done.returncode == 1, done.stderr  # the one sign a launcher sees: the last checkpoint is not there
    last = done.stderr.strip().splitlines()[-1]
    assert "process exits" in last and "did not commit" in last and str(tmp_path / "ck") in last, done.stderr
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["notes.txt"]


def test_a_save_or_export_to_a_symbolic_link_is_refused_and_leaves_link_and_target_alone(tmp_path):
    from checkpoint.tool.cli import main as cli_main

    real = tmp_path / "runs" / "step1"
    checkpoint.save_state_dict(_state(1), real)
    before = sorted(p.name for p in real.iterdir())
    (tmp_path / "latest").symlink_to(real)
    for attempt in range(2):  # the first refusal leaves nothing that changes the second
        with pytest.raises(FileExistsError, match="symbolic link") as raised:
            checkpoint.save_state_dict(_state(2 + attempt), tmp_path / "latest")
        assert str(real) in str(raised.value)
    assert cli_main(["export", str(real), str(tmp_path / "latest"), "--format", "safetensors", "--force", "-q"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "runs"]  # no staging, no swap dir, no lock
    assert (tmp_path / "latest").is_symlink() and sorted(p.name for p in real.iterdir()) == before  # no marker inside
    assert _which_state(tmp_path / "latest") == 1


@pytest.mark.parametrize("name", [".ck.fsdp-ckpt-old", ".ck.fsdp-ckpt-staging"])
@pytest.mark.parametrize("previous", [False, True], ids=["fresh path", "over a checkpoint"])
def test_a_link_at_a_name_a_save_removes_is_refused_naming_it_and_its_target_is_left_intact(tmp_path, name, previous):
    from checkpoint.atomic import MARKER_NAME

    if previous:
        checkpoint.save_state_dict(_state(1), tmp_path / "ck")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (user / MARKER_NAME).write_text("copied along with a directory a save once staged")  # the worst case
    (tmp_path / name).symlink_to(user)
    for attempt in range(2):  # the first refusal leaves nothing that changes the second
        with pytest.raises(FileExistsError, match="symbolic link") as raised:
            checkpoint.save_state_dict(_state(2 + attempt), tmp_path / "ck")
        assert str(tmp_path / name) in str(raised.value)
    assert sorted(p.name for p in user.iterdir()) == sorted(["notes.txt", MARKER_NAME])
    assert (tmp_path / name).is_symlink()
    if previous:
        assert _which_state(tmp_path / "ck") == 1
    else:
        assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("kind", ["directory", "symbolic link"])
def test_something_at_the_lock_name_is_refused_naming_it_and_left_alone(tmp_path, kind):
    lock = tmp_path / ".ck.fsdp-ckpt-lock"
    if kind == "directory":
        lock.mkdir()
        (lock / "notes.txt").write_text("mine")
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError, match=f"is a {kind}, in the way of this save's lock file") as raised:
        checkpoint.save_state_dict(_state(1), tmp_path / "ck")
    assert str(lock) in str(raised.value)
    assert not (tmp_path / "ck").exists() and (lock.is_dir() if kind == "directory" else lock.is_symlink())
