"""Asynchronous save: the caller blocks only until the state is staged.

Two ways to stage, both giving the state *as it was at call time* even
though the caller changes it right after:

* ``max_staging_bytes=None`` (default): a host snapshot of every local tensor
  (a device tensor is copied device -> host once, into pinned memory when
  an accelerator is available; a host-resident tensor, like a ``HybridDeviceOptimizer``'s
  state, host -> host, no device round trip). The caller blocks for the copy
  only; host memory: one checkpoint's worth (this rank's share).
* ``max_staging_bytes=N``: bounded staging (:mod:`checkpoint.staging`). The
  background writer starts on the live tensors at once, while the caller
  copies what the writer has not reached yet, at most ``N`` bytes of copies.
  The caller blocks until every tensor is either written to the OS (page
  cache; not yet fsync'd) or copied. Trade-off: less memory, longer block:
  about the time to write what does not fit in ``N``. ``N=0`` copies
  nothing: host-resident state goes to the file with no copy, and the caller
  blocks until all data is written (but not for the fsyncs, the metadata or
  the commit). A copy of mutable host state cannot be avoided any other way
  if the caller may change it before it is written.

One background thread writes through :func:`checkpoint.save_state_dict` on a
dedicated gloo process group, so its collectives never interleave with
training's. At most one async save is in flight: a new one first waits for
the previous one to finish, so at most one set of staging buffers is alive.
A blocking save waits for it too, so saves to one path commit in call order.

Failures are never silent. A failed async save is logged at ERROR when it
happens, re-raised by its future's ``result()``, and, if nobody asked the
future, raised by the next save (async or blocking) as :class:`AsyncSaveError`,
or by :func:`wait_for_async_save`. A process that exits with a save in
flight finishes it first (a hook run at interpreter exit, before the thread
pools shut down) and logs at ERROR if it could not.

Staging buffers are kept for the next save (:mod:`checkpoint.staging_pool`):
the next save of the same state copies into the same host memory instead of
allocating (pinning, page-faulting) it again. Because a save starts staging
only once the previous one is finished, a buffer is never handed to a save
while another one still reads it. What the last save did not use is freed
after its staging; :func:`release_staging_buffers` frees the rest, and
``reuse_staging_buffers=False`` gives one save fresh buffers and keeps none.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.atomic import DEFAULT_LOCK_TIMEOUT, output_path
from checkpoint.commit import DEFAULT_MAX_CHUNK_BYTES
from checkpoint.convert import convert_tree, resolve_stateful
from checkpoint.safe_unpickle import check_saved_values
from checkpoint.save_errors import raise_on_every_rank
from checkpoint.save_queue import AsyncSaveError, lock, starting, submit, wait_for_async_save
from checkpoint.shard import CheckpointShard
from checkpoint.staging import StagingGate, copy_to_staging, gate_state_dict, replace_shards
from checkpoint.staging_pool import StagingPool
from checkpoint.state_dict_io import write_state_dict

__all__ = ["AsyncSaveError", "async_save_state_dict", "release_staging_buffers", "stage", "wait_for_async_save"]

logger = logging.getLogger(__name__)

_group = None
_pool = StagingPool()  # guarded by save_queue.lock


def _background_group():
    """A gloo group of all ranks, created once, for the writer thread's collectives."""
    global _group
    if _group is None and dist.is_available() and dist.is_initialized():
        _group = dist.new_group(backend="gloo")
    return _group


def release_staging_buffers() -> None:
    """Free the host memory kept for the next async save's staging.

    Safe at any time: a save in flight keeps the buffers it is writing until
    it finishes, and frees them then. The next async save allocates afresh.
    Waits while another thread is inside :func:`async_save_state_dict` (staging).
    """
    with lock:
        _pool.clear()


def stage(
    state_dict: dict[str, Any], *, rank: int, scale: bool, max_chunk_bytes: int | None, pool: StagingPool
) -> dict[str, Any]:
    """A host snapshot of ``state_dict`` with every tensor as a :class:`CheckpointShard` over a copy in ``pool``."""
    converted = convert_tree(state_dict, rank=rank, replicas_on_rank0_only=scale, max_chunk_bytes=max_chunk_bytes)
    devices: set[torch.device] = set()

    def snapshot(key: str, shard: CheckpointShard) -> CheckpointShard:
        copy = copy_to_staging(pool, key, shard.local)
        if shard.local.device.type != "cpu":
            devices.add(shard.local.device)
        return CheckpointShard(copy, shard.spec, writes=shard.writes, max_chunk_bytes=shard.max_chunk_bytes)

    staged = replace_shards(converted, snapshot)
    for device in devices:
        # The non-blocking D2H copies must land before the writer thread reads the snapshot.
        torch.accelerator.synchronize(device)
    return staged


def async_save_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    mode: str = "collective",
    max_chunk_bytes: int | None = DEFAULT_MAX_CHUNK_BYTES,
    process_group: dist.ProcessGroup | None = None,
    max_staging_bytes: int | None = None,
    reuse_staging_buffers: bool = True,
    storage_options: dict | None = None,
    keep_last: int | None = None,
    lock_timeout: float | None = DEFAULT_LOCK_TIMEOUT,
) -> Future:
    """Stage ``state_dict`` now, write and commit it at ``path`` in the background; all ranks call it.

    Returns once the state is staged (see the module docstring for what
    ``max_staging_bytes`` changes), with a ``concurrent.futures.Future`` whose
    ``result()`` is ``None`` once the checkpoint is committed (and re-raises
    the save's error otherwise). The caller may change its tensors as soon as
    this returns. Side effect: the staging buffers stay allocated for the next
    async save unless ``reuse_staging_buffers=False`` (see
    :func:`release_staging_buffers`).
    """
    path = output_path(path, storage_options)  # here: a bad path or URL is the caller's error
    if max_staging_bytes is not None and max_staging_bytes < 0:
        raise ValueError(f"max_staging_bytes must be None (stage everything) or >= 0, got {max_staging_bytes}")
    with starting():  # the interpreter does not exit before this save is submitted, whichever thread stages it
        with lock:
            # Bound staging memory: one save in flight at a time; an unobserved failure of it is raised here.
            # Reusing staging buffers relies on this too: nothing reads the previous save's buffers any more.
            wait_for_async_save()
            _pool.begin_save(reuse=reuse_staging_buffers)
            group = process_group if process_group is not None else _background_group()
            distributed = dist.is_available() and dist.is_initialized()
            error: Exception | None = None
            try:
                # Stateful values' state_dict() once, in sorted key order; a rank where one raises, or a value
                # is refused, raises on every rank below (refused here, in the caller, not later in the background)
                state_dict, _ = resolve_stateful(state_dict)
                check_saved_values(state_dict)
                staged, gate = _stage_now(state_dict, mode, max_chunk_bytes, max_staging_bytes)
            except Exception as exc:  # noqa: BLE001 - raised on every rank
                error = exc
            # The writer threads meet in collectives: a rank whose state cannot be staged must not send the others there.
            raise_on_every_rank(error, path, group=group, distributed=distributed)
            future = submit(
                path,
                write_state_dict,  # refused if the process group it was staged under is gone by then
                staged,
                path,
                distributed=distributed,
                mode=mode,
                max_chunk_bytes=max_chunk_bytes,
                process_group=group,
                keep_last=keep_last,
                lock_timeout=lock_timeout,
            )
            if gate is not None:
                gate.wait_staged(future)
                logger.debug("async save to %s staged with %d bytes of copies", path, gate.copied_bytes)
            _pool.end_staging()
            return future


def _stage_now(
    state_dict: dict[str, Any], mode: str, max_chunk_bytes: int | None, max_staging_bytes: int | None
) -> tuple[dict[str, Any], StagingGate | None]:
    """The state as the writer will read it: a full snapshot, or (bounded) live tensors behind a gate."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if max_staging_bytes is None:
        return stage(state_dict, rank=rank, scale=mode == "scale", max_chunk_bytes=max_chunk_bytes, pool=_pool), None
    converted = convert_tree(
        state_dict, rank=rank, replicas_on_rank0_only=mode == "scale", max_chunk_bytes=max_chunk_bytes
    )
    _synchronize_devices(converted)
    return gate_state_dict(converted, max_staging_bytes, _pool)


def _synchronize_devices(converted: dict[str, Any]) -> None:
    """Wait for the caller's queued work on every device a shard of ``converted`` lives on.

    The writer thread reads live device tensors on its own stream: what the caller queued must land first.
    """
    devices: set[torch.device] = set()

    def note(_key: str, shard: CheckpointShard) -> CheckpointShard:
        if shard.local.device.type != "cpu":
            devices.add(shard.local.device)
        return shard

    replace_shards(converted, note)
    for device in devices:
        torch.accelerator.synchronize(device)
