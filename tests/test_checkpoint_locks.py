"""Who may write a path: a save waiting for another process's write lock gives up clearly after its
``lock_timeout``, and storages without a shared lock refuse (never silently break under) a second writer.

Every other process here is real (forked), held at a known point by a message it sends, never by a sleep.
"""

import logging
import multiprocessing
import os
import signal
import socket
import threading
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import storage_backend
from checkpoint.async_save import async_save_state_dict
from checkpoint.atomic import lock_path, staging_path
from checkpoint.object_commit import CLAIM_PREFIX, HEAD_NAME

PROCESSES = multiprocessing.get_context("fork")  # a saver starts without importing torch again

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _hold_lock(path: str, told, release) -> None:
    """Hold the write lock of ``path`` until a message comes on ``release``; says "held" on ``told`` once it does."""
    from checkpoint.atomic import write_lock

    with write_lock(path):
        told.send("held")
        release.poll(None)


def _state(value: float) -> dict:
    return {"w": torch.full((4, 3), value), "b": torch.arange(5.0) * value}


def _loaded(path) -> dict:
    got = {"w": torch.zeros(4, 3), "b": torch.zeros(5)}
    checkpoint.load_state_dict(got, path, no_dist=True)
    return got


class _Holder:
    """Another process holding ``path``'s write lock, until :meth:`release`."""

    def __init__(self, path: Path) -> None:
        held, says_held = PROCESSES.Pipe(duplex=False)
        waits, self.go = PROCESSES.Pipe(duplex=False)
        # daemon: a test that fails before release() leaves no process behind at exit
        self.proc = PROCESSES.Process(target=_hold_lock, args=(str(path), says_held, waits), daemon=True)
        self.proc.start()
        assert held.recv() == "held"

    def release(self) -> None:
        self.go.send("go")
        self.proc.join(timeout=120)
        assert self.proc.exitcode == 0


def test_a_save_waiting_for_another_process_s_lock_gives_up_after_lock_timeout_naming_the_lock_file_and_holder(
    tmp_path,
):
    path = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1.0), path)
    holder = _Holder(path)
    try:
        for save in (checkpoint.save_state_dict, lambda s, p, **kw: async_save_state_dict(s, p, **kw).result()):
            with pytest.raises(TimeoutError) as caught:
                save(_state(2.0), path, lock_timeout=0.2)
            message = str(caught.value)
            assert str(lock_path(path)) in message and "lock_timeout" in message
            assert f"pid {holder.proc.pid} on host {socket.gethostname()}" in message
            assert not staging_path(path).exists()  # nothing was written
    finally:
        holder.release()
    assert torch.equal(_loaded(path)["w"], torch.full((4, 3), 1.0))  # the checkpoint is untouched
    checkpoint.save_state_dict(_state(3.0), path)  # the lock is free again: a save goes through
    assert torch.equal(_loaded(path)["w"], torch.full((4, 3), 3.0))


def test_a_save_with_lock_timeout_none_waits_for_the_holder_and_then_commits(tmp_path):
    path = tmp_path / "ck"
    holder = _Holder(path)
    waiting = threading.Event()

    class _SeesTheWait(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for another process's save" in record.getMessage():
                waiting.set()

    handler = _SeesTheWait()
    logging.getLogger("checkpoint.storage_backend").addHandler(handler)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            checkpoint.save_state_dict(_state(4.0), path, lock_timeout=None)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    saver = threading.Thread(target=save)
    try:
        saver.start()
        assert waiting.wait(timeout=120)  # the save is waiting on the lock the other process holds
    finally:
        holder.release()
        saver.join(timeout=120)
        logging.getLogger("checkpoint.storage_backend").removeHandler(handler)
    assert not errors and not saver.is_alive()
    assert torch.equal(_loaded(path)["w"], torch.full((4, 3), 4.0))


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_lock_timeout_is_a_value_error_naming_it(tmp_path, bad):
    with pytest.raises(ValueError, match="lock_timeout"):
        checkpoint.save_state_dict(_state(1.0), tmp_path / "ck", lock_timeout=bad)
    assert not (tmp_path / "ck").exists()


def test_a_directory_at_the_lock_name_is_a_clear_error_and_is_left_alone(tmp_path):
    lock_path(tmp_path / "ck").mkdir()
    with pytest.raises(FileExistsError, match=r"\.ck\.fsdp-ckpt-lock.* is a directory.*move it away"):
        checkpoint.save_state_dict(_state(1.0), tmp_path / "ck")
    assert lock_path(tmp_path / "ck").is_dir() and not (tmp_path / "ck").exists()


def _shared_save(path: Path, value: float, at_head: str, told, go) -> None:
    """A forked process's save of ``_state(value)`` to ``path`` (a shared file system: the mount is inherited).

    ``at_head``: ``"hold"`` stops it just before it writes the head of its replacing commit (its last step),
    saying so on ``told``, until ``go`` is set; ``"kill"`` SIGKILLs it there, ``"kill after"`` right after. Exit 0 on success, 3 after
    putting the error's type and message on ``told``.
    """

    def head_written_here(target, data, **kwargs):
        if os.path.basename(target) == HEAD_NAME:
            if at_head == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if at_head == "hold":
                told.put("at the head")
                go.wait()
        write(target, data, **kwargs)
        if os.path.basename(target) == HEAD_NAME and at_head == "kill after":
            os.kill(os.getpid(), signal.SIGKILL)  # committed, its claim not yet removed

    write = storage_backend.durable_write
    storage_backend.durable_write = head_written_here
    try:
        checkpoint.save_state_dict(_state(value), path)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        told.put(f"{type(exc).__name__}: {exc}")
        told.close()
        told.join_thread()  # delivered before the process ends without its exit handlers
        os._exit(3)
    os._exit(0)


class _SharedSaver:
    """Another process saving to ``root / "ck"`` (forked: no second interpreter start)."""

    def __init__(self, root: Path, value: float, at_head: str = "go") -> None:
        self.told, self.go = PROCESSES.Queue(), PROCESSES.Event()
        self.proc = PROCESSES.Process(target=_shared_save, args=(root / "ck", value, at_head, self.told, self.go))
        self.proc.start()

    def outcome(self) -> str:
        self.go.set()
        self.proc.join(timeout=300)
        return {0: "ok", -signal.SIGKILL: "killed"}.get(self.proc.exitcode) or self.told.get(timeout=10)


@pytest.fixture
def shared(tmp_path):
    """A directory mounted as a shared file system (no shared lock), holding a checkpoint of value 1 at ``ck``."""
    root = tmp_path / "nfs"
    checkpoint.mount(root, checkpoint.SharedFileSystemStorage())
    try:
        checkpoint.save_state_dict(_state(1.0), root / "ck")
        yield root
    finally:
        checkpoint.unmount(root)


def test_on_a_shared_file_system_a_save_committing_while_another_holds_the_commit_refuses_and_the_first_wins(shared):
    first = _SharedSaver(shared, 2.0, "hold")
    assert first.told.get(timeout=300) == "at the head"  # its head check passed; the head is not written yet
    second = _SharedSaver(shared, 3.0)
    second_outcome = second.outcome()
    assert (
        second_outcome.startswith("ConcurrentSaveError: another save is committing")
        and "fsdp-ckpt gc" in second_outcome
    )
    assert first.outcome() == "ok"
    assert torch.equal(_loaded(shared / "ck")["w"], torch.full((4, 3), 2.0))  # the save that reported OK
    assert [p.name.split("-")[2] for p in (shared / "ck").iterdir() if p.name.startswith("fsdp-save-")] == ["00000002"]


def test_concurrent_saves_to_a_shared_file_system_each_commit_exactly_or_fail_clearly(shared):
    savers = {value: _SharedSaver(shared, float(value)) for value in range(2, 7)}
    outcomes = {value: saver.outcome().split(":")[0] for value, saver in savers.items()}
    assert set(outcomes.values()) <= {"ok", "ConcurrentSaveError"}, outcomes
    got = _loaded(shared / "ck")
    value = got["w"][0, 0].item()
    assert outcomes.get(int(value)) == "ok", (value, outcomes)  # the checkpoint is one whose saver said OK
    assert torch.equal(got["w"], _state(value)["w"]) and torch.equal(got["b"], _state(value)["b"])


def test_a_save_killed_while_committing_to_a_shared_file_system_leaves_a_claim_that_gc_removes(shared):
    assert _SharedSaver(shared, 2.0, "kill").outcome() == "killed"
    with pytest.raises(checkpoint.ConcurrentSaveError, match=r"fsdp-ckpt-claim-fsdp-save-.* is held by .*fsdp-ckpt gc"):
        checkpoint.save_state_dict(_state(3.0), shared / "ck")
    assert torch.equal(_loaded(shared / "ck")["w"], torch.full((4, 3), 1.0))  # the previous checkpoint, whole
    assert any(name.startswith(CLAIM_PREFIX) for name in checkpoint.collect_garbage(shared / "ck"))
    checkpoint.save_state_dict(_state(3.0), shared / "ck")
    assert torch.equal(_loaded(shared / "ck")["w"], torch.full((4, 3), 3.0))


def test_a_save_killed_after_writing_the_head_on_a_shared_file_system_blocks_no_later_save(shared):
    assert _SharedSaver(shared, 2.0, "kill after").outcome() == "killed"
    assert torch.equal(_loaded(shared / "ck")["w"], torch.full((4, 3), 2.0))  # it committed
    checkpoint.save_state_dict(_state(3.0), shared / "ck")  # its claim names a replaced head: no gc needed
    assert torch.equal(_loaded(shared / "ck")["w"], torch.full((4, 3), 3.0))
    assert not [p for p in (shared / "ck").iterdir() if p.name.startswith(CLAIM_PREFIX)]  # and it was removed


def test_a_save_waiting_for_another_thread_s_save_to_the_same_path_gives_up_after_lock_timeout(tmp_path):
    from checkpoint.atomic import write_lock

    with write_lock(tmp_path / "ck"):  # held by this thread: a save from it waits as another thread's would
        with pytest.raises(TimeoutError, match=r"another save to it in this process.*lock_timeout"):
            checkpoint.save_state_dict(_state(1.0), tmp_path / "ck", lock_timeout=0.1)
    assert not (tmp_path / "ck").exists()


def test_a_failed_async_save_without_a_process_group_is_logged_without_a_process_group_hint(tmp_path, caplog):
    (tmp_path / "ck").write_text("a user's file")  # the target check fails in the writer thread
    with caplog.at_level(logging.ERROR, logger="checkpoint.save_queue"):
        with pytest.raises(FileExistsError, match="it is a file"):
            async_save_state_dict(_state(1.0), tmp_path / "ck").result()
    (logged,) = [r.getMessage() for r in caplog.records if "async checkpoint save" in r.getMessage()]
    assert "it is a file" in logged and "process group" not in logged  # no group ever existed in this process
