"""Bounded staging for async saves: hand a state to the writer thread with at most N bytes of copies.

An async save must write the state *as it was at call time*, while the
caller goes on training and changes it. A full host snapshot does that at
the cost of one checkpoint's worth of host memory. :class:`StagingGate` does
it within a byte budget: the caller blocks until every tensor is either

* **written**: the writer thread has handed its bytes, read from the live
  tensor, to the OS (page cache; the fsync comes later, after the caller has
  returned), or
* **copied**: the caller copied it into a private buffer (device tensors into
  pinned host memory; the buffer comes from a :class:`~checkpoint.staging_pool.StagingPool`,
  so a later save reuses it), and the writer will write the copy,

and whatever the writer has not reached yet is copied by the caller, from the
end of the write order backwards, while the copies fit in the budget. So the
caller blocks for about the time it takes to write what does not fit in the
budget; with ``budget=0`` nothing is copied (a host-resident tensor, such as a
``HybridDeviceOptimizer``'s state, goes to the file with no copy at all) and
the caller blocks until all data is written, but not for the fsyncs, the
metadata or the commit. Non-tensor values are written first and are gated too.

The writer side is :class:`checkpoint.storage.FsdpWriter`: it calls
:meth:`StagingGate.begin` with its plan, reads each tensor through
:meth:`StagedShard.__get_tensor_shard__` (which claims it), and calls
:meth:`StagingGate.written` after each item.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from checkpoint.convert import flatten_state_dict
from checkpoint.shard import CheckpointShard
from checkpoint.staging_pool import StagingPool

__all__ = ["StagedShard", "StagingGate", "copy_to_staging", "gate_state_dict", "replace_shards"]


class StagedShard(CheckpointShard):
    """A :class:`CheckpointShard` over a live tensor whose reads by the writer go through a :class:`StagingGate`."""

    gate: StagingGate
    key: str

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        # Blocks while the caller is copying this tensor; after it, self.local is the live tensor or its copy.
        self.gate.claim(self.key)
        return super().__get_tensor_shard__(index)


class StagingGate:
    """Who holds each tensor of one async save: not yet staged, claimed by the writer, copied, written."""

    def __init__(self, budget: int, pool: StagingPool) -> None:
        if budget < 0:
            raise ValueError(f"max_staging_bytes must be >= 0, got {budget}")
        self.budget = budget
        self.pool = pool
        self.copied_bytes = 0
        """bytes of private copies made (never more than ``budget``)"""
        self._cond = threading.Condition()
        self._leaves: dict[str, StagedShard] = {}
        self._pending: dict[str, int] | None = None  # key -> items still to write; None until the plan is known
        self._claimed: set[str] = set()
        self._copying: set[str] = set()
        self._copied: set[str] = set()
        self._failed = False

    def add(self, key: str, leaf: StagedShard) -> None:
        leaf.gate, leaf.key = self, key
        self._leaves[key] = leaf

    # --- writer thread ---

    def begin(self, items: list[MetadataIndex]) -> None:
        """The writer's plan for this rank: which keys it will write, and how many items each."""
        pending: dict[str, int] = {}
        for item in items:
            pending[item.fqn] = pending.get(item.fqn, 0) + 1
        with self._cond:
            self._pending = pending
            self._cond.notify_all()

    def claim(self, key: str) -> None:
        with self._cond:
            while key in self._copying:
                self._cond.wait()
            if key not in self._copied:
                self._claimed.add(key)

    def written(self, key: str) -> None:
        """One item of ``key`` is in the OS's hands."""
        with self._cond:
            if self._pending is not None and key in self._pending:
                self._pending[key] -= 1
                if self._pending[key] == 0:
                    del self._pending[key]
                    self._cond.notify_all()

    # --- caller ---

    def wait_staged(self, future: Future) -> None:
        """Block until nothing of the state is read from the caller's tensors any more.

        Copies unclaimed tensors within the budget meanwhile. Returns early
        when ``future`` finishes (a failed save has nothing more to read).
        """
        future.add_done_callback(self._on_done)
        try:
            self._stage()
        finally:
            # The future keeps this gate alive (its done callback): let go of the copies, so they
            # are freed with the staged state (or by StagingPool.clear), not with the future.
            self._leaves = {}

    def _stage(self) -> None:
        with self._cond:
            while self._pending is None and not self._failed:
                self._cond.wait()
            while not self._failed:
                assert self._pending is not None  # the wait above: set once the plan is known, never unset
                remaining = [k for k in self._pending if k not in self._copied]
                if not remaining:
                    return
                key = self._next_to_copy(remaining)
                if key is None:
                    self._cond.wait()
                    continue
                self._copying.add(key)
                self._cond.release()
                try:
                    copy = _private_copy(self.pool, key, self._leaves[key].local)
                finally:
                    self._cond.acquire()
                self._leaves[key].local = copy
                self.copied_bytes += copy.numel() * copy.element_size()
                self._copying.discard(key)
                self._copied.add(key)
                self._cond.notify_all()

    def _next_to_copy(self, remaining: list[str]) -> str | None:
        """The last tensor in write order that the writer has not claimed and that fits in the budget."""
        for key in reversed(remaining):
            leaf = self._leaves.get(key)
            if leaf is None or key in self._claimed:
                continue
            nbytes = leaf.local.numel() * leaf.local.element_size()
            if self.copied_bytes + nbytes <= self.budget:
                return key
        return None

    def _on_done(self, _future: Future) -> None:
        with self._cond:
            self._failed = True  # finished (or failed): nothing will be read any more either way
            self._cond.notify_all()


def copy_to_staging(pool: StagingPool, key: str, local: torch.Tensor) -> torch.Tensor:
    """``local`` copied into ``pool``'s host buffer for ``key``.

    A copy from a device is asynchronous (into pinned memory): the caller
    synchronises before anything reads the result.
    """
    on_device = local.device.type != "cpu"
    return pool.buffer(key, local).copy_(local, non_blocking=on_device)


def _private_copy(pool: StagingPool, key: str, local: torch.Tensor) -> torch.Tensor:
    copy = copy_to_staging(pool, key, local)
    if local.device.type != "cpu":
        # The D2H copy must land before the writer thread reads the copy.
        torch.accelerator.current_stream(local.device).synchronize()
    return copy


def replace_shards(
    converted: dict[str, Any], replace: Callable[[str, CheckpointShard], CheckpointShard]
) -> dict[str, Any]:
    """``converted`` with every :class:`CheckpointShard` leaf replaced by ``replace(key, shard)``.

    ``key`` is DCP's flattened key, the one the writer's items carry (and the
    staging buffers are keyed by). The tree is rebuilt; ``converted`` is not changed. A list referenced
    from several places is rebuilt once, the new one referenced likewise (torch's flattened optimizer
    layout references a group's ``param_names`` from each parameter's key: O(N^2) if rebuilt per reference).
    """
    flat, _ = flatten_state_dict(converted)
    by_id = {id(value): replace(key, value) for key, value in flat.items() if isinstance(value, CheckpointShard)}
    rebuilt: dict[int, list] = {}  # id of a list of ``converted`` (which keeps it alive) -> its new list

    def swap(tree):
        if isinstance(tree, dict):
            return {k: swap(v) for k, v in tree.items()}
        if isinstance(tree, list):
            new = rebuilt.get(id(tree))
            if new is None:
                new = rebuilt[id(tree)] = [swap(v) for v in tree]
            return new
        return by_id.get(id(tree), tree)

    return swap(converted)


def gate_state_dict(converted: dict[str, Any], budget: int, pool: StagingPool) -> tuple[dict[str, Any], StagingGate]:
    """``converted`` (leaves already :class:`CheckpointShard`) with every shard wrapped for ``gate``.

    Copies the caller makes within ``budget`` go into ``pool``'s buffers.
    """
    gate = StagingGate(budget, pool)

    def wrap(key: str, shard: CheckpointShard) -> StagedShard:
        staged = StagedShard(shard.local, shard.spec, writes=shard.writes, max_chunk_bytes=shard.max_chunk_bytes)
        gate.add(key, staged)
        return staged

    return replace_shards(converted, wrap), gate
