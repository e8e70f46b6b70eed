"""The host update overlapped with the final backward (``overlap_step_with_backward=True``).

Default mode: every host bucket is updated inside ``step()``, after the whole
backward, so a step costs about ``T_backward + T_host``. In this mode the
post-accumulate-grad hook that stages a grad also counts it: when every record
of a bucket has its final grad staged, the bucket's update (``HostUpdate.update``:
wait for its D2H, update; step() queues its H2D) is handed to one host worker thread,
in gradient-arrival order, while backward goes on. ``step()`` then waits for
what is still running and does the rest (buckets not complete during backward,
the device share), so the step costs about ``max(T_backward, T_host)`` plus one
bucket.

What this module owns: :class:`HostWorker` (the thread, its queue, errors
carried to the caller), :class:`OverlappedStep` (per-bucket readiness, what
started this step and the checks ``step()`` makes before finishing it), and a
registry of parameters under such an optimizer (:func:`refuse_overlapped`, used
by ``optim.clip_grad_norm_``: a norm over all grads is known only after backward,
when part of the update has already run).

Nothing here imports the optimizer: it is handed the two calls it needs.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from offload_fsdp.defaults import same_value, snapshot_value
from offload_fsdp.delegate import hyperparameters
from offload_fsdp.grad import get_grad, local_tensor
from offload_fsdp.records import grad_key

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket
    from offload_fsdp.copy_engine import CopyEngine
    from offload_fsdp.records import ParamShard
    from offload_fsdp.speculative import SpeculativeClip

__all__ = ["HostWorker", "OverlappedStep", "refuse_overlapped", "speculation_of"]

_STOP = object()
_DEFER_HINT = (
    "wrap the backward of every micro-batch but the last in `with optimizer.defer_grad_copies():` "
    "(or, under FSDP2, set_requires_gradient_sync(False)) so only the final backward starts updates"
)

# param -> (the optimizer that updates it during backward, weakly; the param's name; its SpeculativeClip or None);
# read by optim's clipping.
_OVERLAPPED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def refuse_overlapped(params: Iterable[Any], what: str) -> None:
    """``ValueError`` when one of ``params`` is updated during backward by an overlapped optimizer
    built without ``speculative_clipping`` (with it, ``step()`` redoes what an edit of the grads invalidated).

    ``what`` names the refused operation (e.g. ``"optim.clip_grad_norm_"``). Such a
    param's update may already have run with the unclipped grad when the norm becomes
    known, so a norm-based edit of its grad cannot be honoured; nothing is silently changed.
    """
    for p in params:
        entry = _live_entry(p)
        if entry is not None and entry[1] is None:
            raise ValueError(
                f"{what} was given parameter {entry[0]!r} of a HybridDeviceOptimizer built with "
                "overlap_step_with_backward=True: their host update starts during backward, before the norm "
                "of all gradients is known. Build the optimizer with speculative_clipping=True (updates are "
                "snapshotted and redone when the clip changes a gradient), or without overlap_step_with_backward"
            )


def _live_entry(param: Any) -> tuple[str, SpeculativeClip | None] | None:
    """(name, speculative clipping or None) of ``param`` under a live overlapped optimizer, else None."""
    owner, name, speculation = (
        _OVERLAPPED.get(param, (None, "", None)) if isinstance(param, torch.Tensor) else (None, "", None)
    )
    return (name, speculation) if owner is not None and owner() is not None else None


def speculation_of(param: Any) -> SpeculativeClip | None:
    """The speculative clipping of the live overlapped optimizer updating ``param``, if it has one."""
    entry = _live_entry(param)
    return entry[1] if entry is not None else None


@dataclass
class _Failure:
    what: str
    error: BaseException


def _run_jobs(jobs: queue.Queue, failures: list[_Failure], on_start: Callable[[], None]) -> None:
    """The worker thread's loop. It holds no reference to the optimizer between jobs."""
    try:
        on_start()  # before the first job creates threads of its own (they inherit its core binding)
    except BaseException as exc:  # noqa: BLE001 - the jobs are then skipped and step() raises it
        failures.append(_Failure("the host worker's start (core binding)", exc))
    # Grad mode is thread-local: the host update must not record autograd history.
    torch.set_grad_enabled(False)
    while True:
        job = jobs.get()
        try:
            if job is _STOP:
                return
            what, fn = job
            if not failures:  # after a failure the rest is skipped; step() raises the first one
                fn()
        except BaseException as exc:  # noqa: BLE001 - carried to the caller's thread, never lost
            failures.append(_Failure(what, exc))
        finally:
            job = fn = None  # the job holds the optimizer: drop it before waiting for the next one
            jobs.task_done()


_JOIN_TIMEOUT_S = 60.0
"""How long collecting the optimizer (or interpreter exit) waits for a job still running; the
thread is a daemon, so a job that never ends (a device that hangs) cannot hang the exit."""


def _stop(jobs: queue.Queue, thread: threading.Thread) -> None:
    jobs.put(_STOP)
    if thread is not threading.current_thread():  # collected on the worker itself: it stops after this job
        thread.join(_JOIN_TIMEOUT_S)


class HostWorker:
    """One daemon thread running submitted jobs in order; errors are re-raised by :meth:`wait`.

    The thread starts at the first job and is stopped and joined when this object
    is collected (or at interpreter exit), so it never outlives its optimizer.
    """

    def __init__(self, on_start: Callable[[], None] = lambda: None) -> None:
        self._on_start = on_start  # run on the thread as it starts (core binding)
        self._jobs: queue.Queue = queue.Queue()
        self._failures: list[_Failure] = []
        self._thread: threading.Thread | None = None
        self._pid = 0

    def submit(self, what: str, fn: Callable[[], None]) -> None:
        """Queue ``fn``; ``what`` names it in the error if it raises."""
        if self._thread is None or self._pid != os.getpid():  # a forked child has no copy of the thread
            self._jobs, self._pid = queue.Queue(), os.getpid()
            self._thread = threading.Thread(
                target=_run_jobs,
                args=(self._jobs, self._failures, self._on_start),
                name="offload_fsdp-host-step",
                daemon=True,
            )
            self._thread.start()
            weakref.finalize(self, _stop, self._jobs, self._thread)
        self._jobs.put((what, fn))

    def raise_failure(self) -> None:
        """Raise the first failed job's error (naming it) without waiting for the others, if one failed."""
        if self._failures:  # kept until forget_failures(): every later call raises it too
            failure = self._failures[0]
            self.wait_quietly()
            raise RuntimeError(
                f"the overlapped host update of {failure.what} failed: {failure.error!r}; the step was only partly "
                "applied (buckets updated before the failure keep their update): restore from a checkpoint"
            ) from failure.error

    def forget_failures(self) -> None:
        """Called once the step that failed has ended (raised to the user)."""
        self._failures.clear()

    def wait_quietly(self) -> None:
        """Block until every submitted job has finished (or been skipped)."""
        self._jobs.join()

    def wait(self) -> None:
        """Block until every submitted job has finished; raise the first failure."""
        self.wait_quietly()
        self.raise_failure()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread


def _staged_is_current(r: ParamShard) -> bool:
    """True when ``r``'s grad is the very tensor, unmodified, that was staged (``records.grad_key``)."""
    grad = get_grad(r.param)
    return grad is not None and grad_key(local_tensor(grad)) == r.staged_grad_key


def _staged_equals_grad(r: ParamShard) -> bool:
    """True when ``r``'s host grad staging holds, bit for bit, its grad as it is now.

    Checked for every started record: writes below autograd (``p.grad.data.mul_``,
    ``dist.all_reduce(p.grad)`` after backward, ``_foreach_*`` ops on a DTensor's local
    shard) move no version counter (``records.grad_key``).
    """
    grad = get_grad(r.param)
    assert grad is not None  # a started record with a current key
    return r.staging_holds(local_tensor(grad))


class OverlappedStep:
    """Readiness counting and the started buckets of the current step (one per optimizer).

    Called on the thread that runs backward (the hooks) and by ``step()``; only the
    submitted jobs run on the worker. ``prepare``: the optimizer's main-thread work
    before a bucket's update (master refresh). ``update``: the bucket's update
    itself (``HostUpdate.update``), run on the worker. ``group``: a param group by index.
    """

    def __init__(
        self,
        prepare: Callable[[HostBucket], None],
        update: Callable[[HostBucket, list[ParamShard]], None],
        group: Callable[[int], dict[str, Any]],
        on_worker_start: Callable[[], None] = lambda: None,
        speculation: SpeculativeClip | None = None,
    ) -> None:
        self.worker = HostWorker(on_worker_start)
        self.speculation = speculation  # speculative_clipping: snapshots before updates, settled in step()
        self._prepare, self._update, self._group = prepare, update, group
        self._ready: dict[int, set[int]] = {}
        """bucket index -> ids of its records whose final grad is staged this step"""
        self._started: dict[int, tuple[HostBucket, dict[str, Any]]] = {}
        """bucket index -> (bucket, its group's hyper-parameters when its update was queued)"""
        self._started_records: set[int] = set()
        self._updated: list[HostBucket] = []
        """buckets whose update finished on the worker (appended there; read after ``worker.wait``)"""
        self.begun_engines: dict[int, CopyEngine] = {}
        """copy engines whose ``begin_step`` ran during backward (step() must not run it again)"""
        self._backward_open = False
        """a backward counted a final grad and has not finished: True after it, when that backward raised"""

    def register(self, records: Iterable[ParamShard], owner: object) -> None:
        """Mark the offloaded ``records``' params for :func:`refuse_overlapped`."""
        ref = weakref.ref(owner)
        for r in records:
            if r.offloaded:
                _OVERLAPPED[r.param] = (ref, r.name, self.speculation)

    @property
    def in_progress(self) -> bool:
        """True between the first bucket queued during backward and the end of ``step()``."""
        return bool(self._started)

    def check_not_started(self, record: ParamShard) -> None:
        """A grad arriving for a record whose update already started this step is refused, naming it."""
        self.worker.raise_failure()
        if id(record) in self._started_records:
            raise RuntimeError(
                f"parameter {record.name!r} received a gradient in another backward after its overlapped host "
                f"update (bucket {record.host_bucket.index}) started this step, so that gradient would be "
                f"ignored; {_DEFER_HINT}"
            )

    def grad_final(self, record: ParamShard) -> None:
        """``record``'s grad is final and staged: queue its bucket's update once all of its records are."""
        self.check_not_started(record)
        self._watch_backward()
        bucket = record.host_bucket
        ready = self._ready.setdefault(bucket.index, set())
        ready.add(id(record))
        # Every record counted, and each one's staged grad is still its current grad (a count left
        # from a backward whose grads were zeroed since must not start an update on stale staging).
        if len(ready) == len(bucket.records) and all(_staged_is_current(r) for r in bucket.records):
            if self.speculation is None or self.speculation.reserve(bucket):  # else step() updates it
                self._start(bucket)

    def _watch_backward(self) -> None:
        """Note that a backward is running until autograd runs its final callbacks, which it skips when it raises."""
        if not self._backward_open:
            self._backward_open = True
            # Private `queue_callback` (no public "backward finished" hook; FSDP2 uses it the same way):
            # it runs only when this backward completes, so a flag still set afterwards means it raised.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        self._backward_open = False

    @property
    def backward_raised(self) -> bool:
        """True when the backward that started this step's updates raised before it finished."""
        return self.in_progress and self._backward_open

    def check_backward_finished(self, what: str) -> None:
        """``RuntimeError`` naming the fix when the backward that started updates raised (see :attr:`backward_raised`).

        torch's optimizer would never have applied anything: the step is refused (``step()``,
        ``zero_grad()``, ``state_dict()``) until :meth:`discard` (a ``load_state_dict``).
        """
        if self.backward_raised:
            raise RuntimeError(
                f"{what} refused: the backward that started the overlapped host update of buckets "
                f"{sorted(self._started)} raised before it finished, and those updates already changed the "
                "buckets' masters and optimizer state (the model's params are unchanged: only step() writes "
                "them). torch's optimizer would have applied nothing, and this one cannot take the update back: "
                "load the optimizer state from your last checkpoint (optimizer.load_state_dict or "
                "checkpoint.load), which ends this step, or build a new optimizer"
            )

    def _start(self, bucket: HostBucket) -> None:
        self._prepare(bucket)
        engine = bucket.engine
        if id(engine) not in self.begun_engines:
            engine.begin_step()
            self.begun_engines[id(engine)] = engine
        else:
            # Backward has queued every read of this bucket's params by now: its H2D may follow.
            engine.note_params_read()
        group = bucket.records[0].group_index
        snapshot = {k: snapshot_value(v) for k, v in hyperparameters(self._group(group)).items()}
        self._started[bucket.index] = (bucket, snapshot)
        self._started_records.update(id(r) for r in bucket.records)
        names = ", ".join(repr(r.name) for r in bucket.records[:4]) + (", ..." if len(bucket.records) > 4 else "")
        records = list(bucket.records)
        self.worker.submit(
            f"bucket {bucket.index} (params {names})", lambda: self._update_on_its_device(bucket, records)
        )

    def _update_on_its_device(self, bucket: HostBucket, records: list[ParamShard]) -> None:
        # The current device is per thread: the worker's default need not be this rank's device.
        if bucket.device.type != "cpu" and bucket.device.index is not None:
            torch.accelerator.set_device_index(bucket.device.index)
        if self.speculation is not None:
            self.speculation.take(bucket)
        self._update(bucket, records)
        self._updated.append(bucket)

    def updated_buckets(self) -> list[HostBucket]:
        """The buckets updated during backward whose params ``step()`` has yet to write, in update order."""
        self.worker.wait_quietly()
        updated, self._updated = self._updated, []
        return updated

    def finish_backward(self, *, keep: bool = True) -> set[int]:
        """Wait for the queued updates; check that they used what ``step()`` would use.

        Returns the ids of the records updated during backward and kept. Raises (naming the
        param or group and the fix) when a started record's grad changed or went
        away since its update began, or a started bucket's hyper-parameters changed;
        with ``speculation`` a bucket whose grads changed (every one if not ``keep``) is restored instead and
        left to ``step()``.
        """
        self.worker.wait()
        redo: set[int] = set()
        for bucket, snapshot in self._started.values():
            group_index = bucket.records[0].group_index
            now = hyperparameters(self._group(group_index))
            changed = sorted(k for k in snapshot.keys() | now.keys() if not same_value(snapshot.get(k), now.get(k)))
            if changed:
                raise ValueError(
                    f"param group {group_index}: hyper-parameters {changed} changed after the overlapped host update "
                    f"of bucket {bucket.index} ran during backward with the old values; with "
                    "overlap_step_with_backward=True step the LR scheduler (or edit param_groups) after "
                    "optimizer.step(), not between backward and step"
                )
            speculation = self.speculation
            settled = speculation.settle(bucket, self._grad_unchanged, keep=keep) if speculation is not None else None
            if settled:
                redo.add(bucket.index)
            elif settled is None:
                for r in bucket.records:
                    self._check_grad_unchanged(r)
        self._updated = [b for b in self._updated if b.index not in redo]
        return {id(r) for b, _ in self._started.values() if b.index not in redo for r in b.records}

    @staticmethod
    def _grad_unchanged(r: ParamShard) -> bool:
        return _staged_is_current(r) and _staged_equals_grad(r)

    @classmethod
    def _check_grad_unchanged(cls, r: ParamShard) -> None:
        if not cls._grad_unchanged(r):
            raise ValueError(
                f"the gradient of parameter {r.name!r} was changed in place or replaced after its overlapped host "
                "update started during backward (gradient clipping, GradScaler.unscale_, a manual edit such as "
                "p.grad.data.mul_, zero_grad, your own dist.all_reduce(p.grad) after backward, or "
                "DistributedDataParallel, whose all-reduce writes the averaged grads after the hooks ran), so the "
                "update used the old gradient. Build the optimizer with speculative_clipping=True (such a bucket "
                "is then redone in step()), or leave gradients untouched between backward and step() (reduce "
                "them in a backward hook, shard with FSDP2 (fully_shard) rather than DDP), or build the "
                "optimizer without overlap_step_with_backward"
            )

    def forget_readiness(self) -> None:
        """Grads were zeroed without a step: no grad counted so far is final any more."""
        self._ready.clear()
        self._backward_open = False

    def end_step(self) -> None:
        """Forget this step's readiness and started buckets (after ``step()``, successful or not)."""
        self.worker.wait_quietly()
        self.worker.forget_failures()
        if self.speculation is not None:
            self.speculation.end_step()
        self._ready.clear()
        self._started.clear()
        self._started_records.clear()
        self._updated.clear()
        self.begun_engines.clear()
        self._backward_open = False

    def discard(self) -> list[HostBucket]:
        """End a step whose backward raised (:attr:`backward_raised`) without writing any param.

        Returns the buckets whose update ran, for the caller to restore their host copies.
        """
        self.worker.wait_quietly()
        started = [bucket for bucket, _ in self._started.values()]
        for engine in self.begun_engines.values():
            engine.end_step()  # nothing was pushed: the next forward has nothing to wait for
        self.end_step()
        return started

    def check_idle(self, what: str) -> None:
        """``RuntimeError`` when updates started during backward and ``step()`` has not finished them."""
        self.check_backward_finished(what)
        if self.in_progress:
            started = sorted(self._started)
            raise RuntimeError(
                f"{what} was called after the overlapped host update of buckets {started} started during "
                "backward and before optimizer.step() finished the step; call optimizer.step() first (with "
                "overlap_step_with_backward=True a backward that is not wrapped in defer_grad_copies() "
                "commits to the step)"
            )
