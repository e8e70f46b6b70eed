"""Bounded staging for async saves: hand a state to the writer thread with at most N bytes of copies.

An async save must write the state *as it was at call time*, while the
caller goes on training and changes it. A full host snapshot does that at
the cost of one checkpoint's worth of host memory. :class:`StagingGate` does
it within a byte budget: the caller blocks until every tensor is either

* **written**: the writer thread has handed its bytes, read from the live
  tensor, to the OS (page cache; the fsync comes later, after the caller has
  returned), or
* **copied**: the caller copied it into a private buffer (device tensors into
  pinned host memory), and the writer will write the copy,

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
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from checkpoint.shard import CheckpointShard

__all__ = ["StagedShard", "StagingGate", "gate_state_dict"]


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

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"max_staging_bytes must be >= 0, got {budget}")
        self.budget = budget
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

    def begin(self, items: list[WriteItem]) -> None:
        """The writer's plan for this rank: which keys it will write, and how many items each."""
        pending: dict[str, int] = {}
        for item in items:
            pending[item.index.fqn] = pending.get(item.index.fqn, 0) + 1
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
        with self._cond:
            while self._pending is None and not self._failed:
                self._cond.wait()
            while not self._failed:
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
                    copy = _private_copy(self._leaves[key].local)
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


def _private_copy(local: torch.Tensor) -> torch.Tensor:
    on_device = local.device.type != "cpu"
    copy = torch.empty(local.shape, dtype=local.dtype, pin_memory=on_device and torch.cuda.is_available())
    copy.copy_(local, non_blocking=on_device)
    if on_device:
        # The D2H copy must land before the writer thread reads the copy.
        torch.cuda.current_stream(local.device).synchronize()
    return copy


def gate_state_dict(converted: dict[str, Any], budget: int) -> tuple[dict[str, Any], StagingGate]:
    """``converted`` (leaves already :class:`CheckpointShard`) with every shard wrapped for ``gate``.

    Keys are DCP's flattened keys, the ones the writer's items carry.
    """
    gate = StagingGate(budget)
    flat, _ = flatten_state_dict(converted)
    by_id = {}
    for key, value in flat.items():
        if isinstance(value, CheckpointShard):
            staged = StagedShard(value.local, value.spec, writes=value.writes, max_chunk_bytes=value.max_chunk_bytes)
            gate.add(key, staged)
            by_id[id(value)] = staged

    def swap(tree):
        if isinstance(tree, dict):
            return {k: swap(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [swap(v) for v in tree]
        return by_id.get(id(tree), tree)

    return swap(converted), gate
