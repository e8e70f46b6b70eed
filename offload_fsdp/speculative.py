"""Gradient clipping in the overlapped mode: speculative host updates, committed or redone (``speculative_clipping``).

With ``overlap_step_with_backward=True`` a bucket's host update starts during
backward, before the norm of all gradients is known. With ``speculative_clipping``
each host-kernel bucket's master and optimizer state are copied (a *snapshot*)
right before that update, and the update runs as if no clip applies. Then, in
``step()``, each bucket updated during backward is settled:

* every gradient it used is still the one it was staged from, bit for bit, or was
  only multiplied by a clip coefficient of exactly 1 (``optim.clip_grad_norm_``
  tells this module its coefficient, :func:`clip_notes`): the update is **committed**;
* otherwise (a coefficient below 1, a non-finite norm, any other in-place edit such
  as torch's own ``clip_grad_norm_``): the bucket is **restored** from its snapshot
  and ``step()`` updates it again with the gradients as they are now (copied to the
  host again), exactly as the default mode does.

AMP: with a ``GradScaler`` (``GradScaler.step(optimizer)``) the updates during backward
ran on still-scaled grads, so every bucket is restored: an inf/NaN found by the scaler
ends the step there (nothing applied, as torch skips it), otherwise ``step()`` unscales
and updates every bucket after backward. Exact, but with a scaler nothing is committed.

So both branches give the bits of the same clip followed by the same optimizer
without offload: the committed one used the very gradients, the redone one is the
default mode's step.

Host memory: a snapshot holds a bucket's master and state buffers: bytes per
param = the master's element size (4 for fp32) plus its state's (AdamW: 8 with
fp32 moments, 4 with bf16 ones; SGD: 4 with momentum, 0 without), plus 4 bytes per
param *tensor* for Adam's ``step``. ``clip_snapshot_bytes`` bounds what is held in
one step: a bucket whose snapshot would not fit (or that has no host kernel:
a delegated optimizer's state is not flat) is not started during backward and is
updated by ``step()`` after the clip instead: the after-backward step for that
bucket, counted in :attr:`SpeculativeClip.counts` (``optimizer.speculation_counts``).
Snapshot buffers are kept from one step to the next (those of the buckets snapshotted in the
last step only, so never more than the budget) to spare an allocation per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from offload_fsdp.grad import get_grad, local_tensor
from offload_fsdp.records import grad_key

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket
    from offload_fsdp.records import ParamShard

__all__ = ["SpeculationCounts", "SpeculativeClip", "snapshot_bytes"]


@dataclass(frozen=True)
class SpeculationCounts:
    """What speculative clipping did so far (buckets, summed over steps)."""

    committed: int = 0
    """buckets updated during backward whose update was kept"""
    redone: int = 0
    """buckets updated during backward, restored from their snapshot and updated again by ``step()``"""
    deferred: int = 0
    """buckets left to ``step()`` (after backward) because their snapshot did not fit ``clip_snapshot_bytes``
    or they have no host kernel"""
    fallback_steps: int = 0
    """steps with at least one deferred bucket"""


def snapshot_bytes(bucket: HostBucket) -> int:
    """Host bytes one snapshot of ``bucket`` holds (its master and flat state buffers, Adam's ``step`` scalars)."""
    tensors = [bucket.master, *bucket.state.values()]
    steps = 4 * len(bucket.records) if bucket.kernel is not None and bucket.kernel.has_step else 0
    return sum(t.numel() * t.element_size() for t in tensors if t is not None) + steps


@dataclass
class _Snapshot:
    master: torch.Tensor | None
    state: dict[str, torch.Tensor]
    records: dict[int, tuple[bool, torch.Tensor | None, bool]]
    """record id -> (it had state; its ``step`` value, if it keeps one; its ``placeholder_state``)"""


@dataclass
class _ClipNote:
    coefficient: torch.Tensor
    keys: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    """id(param) -> its grad's key right before and right after the clip scaled it"""


class SpeculativeClip:
    """Snapshots, the clip's notes and the counts of one overlapped optimizer.

    ``budget``: ``clip_snapshot_bytes`` (None: no bound). ``forget``: drops a record's state (the
    optimizer's ``_forget``), for a record that had none before the speculative update.
    """

    def __init__(self, budget: int | None, forget: Callable[[ParamShard], None]) -> None:
        self.budget, self._forget = budget, forget
        self._reserved: dict[int, int] = {}
        """bucket index -> snapshot bytes reserved this step"""
        self._snapshots: dict[int, _Snapshot] = {}
        self._buffers: dict[int, list[torch.Tensor]] = {}
        """bucket index -> last step's snapshot buffers of it, reused (at most the budget: only those snapshotted)"""
        self._notes: dict[int, _ClipNote] = {}
        """id(param) -> the clip that scaled its grad this step"""
        self._deferred: set[int] = set()
        """bucket indices deferred this step"""
        self.counts = SpeculationCounts()

    def _count(self, **increments: int) -> None:
        self.counts = dataclasses.replace(
            self.counts, **{k: getattr(self.counts, k) + v for k, v in increments.items()}
        )

    def reserve(self, bucket: HostBucket) -> bool:
        """Whether ``bucket`` may start during backward (its snapshot fits); else it is counted as deferred."""
        if bucket.index in self._deferred:
            return False  # counted when first deferred this step
        need = snapshot_bytes(bucket)
        if bucket.kernel is None or (self.budget is not None and sum(self._reserved.values()) + need > self.budget):
            self._count(deferred=1)
            self._deferred.add(bucket.index)
            return False
        self._reserved[bucket.index] = need
        return True

    def take(self, bucket: HostBucket) -> None:
        """Copy ``bucket``'s master, state and per-record step / placeholder flag (on the worker, before its update)."""
        buffers = self._buffers.pop(bucket.index, None) or [torch.empty_like(t) for t in _flats(bucket)]
        for buffer, flat in zip(buffers, _flats(bucket)):
            buffer.copy_(flat)
        master = buffers[0] if bucket.master is not None else None
        state = dict(zip(bucket.state, buffers[1:] if bucket.master is not None else buffers))
        records: dict[int, tuple[bool, torch.Tensor | None, bool]] = {}
        for r in bucket.records:
            step = r.state.get("step") if r.state is not None else None
            saved = local_tensor(step).clone() if isinstance(step, torch.Tensor) else None
            records[id(r)] = (r.state is not None, saved, r.placeholder_state)
        self._snapshots[bucket.index] = _Snapshot(master, state, records)

    def note_clip(self, params: list[torch.Tensor], before: list[Any], coefficient: torch.Tensor) -> None:
        """``params``' grads were just scaled by ``coefficient`` (``optim.clip_grad_norm_``); ``before``: their
        :func:`grad_keys` taken before."""
        note = _ClipNote(coefficient)
        for p, key in zip(params, before):
            note.keys[id(p)] = (key, _key_of(p))
            self._notes[id(p)] = note

    def settle(self, bucket: HostBucket, unchanged: Callable[[ParamShard], bool], *, keep: bool = True) -> bool | None:
        """Commit (False) or restore (True) ``bucket``'s speculative update; None when it took no snapshot.

        ``unchanged(record)``: whether the record's grad is still the one staged (the usual check).
        A grad a clip scaled by exactly 1 is unchanged; its staging key is moved to its current key.
        ``keep=False``: restore whatever the grads (AMP: the update ran on still-scaled grads).
        """
        snapshot = self._snapshots.get(bucket.index)
        if snapshot is None:
            return None
        if keep and all(self._scaled_by_one(r) and unchanged(r) for r in bucket.records):
            self._count(committed=1)
            return False
        self._restore(bucket, snapshot)
        self._count(redone=1)
        return True

    def _scaled_by_one(self, r: ParamShard) -> bool:
        note = self._notes.get(id(r.param))
        if note is None:
            return True
        if float(note.coefficient) != 1.0:  # below 1, or NaN from a non-finite norm
            return False
        before, after = note.keys[id(r.param)]
        if before is not None and r.staged_grad_key == before and _key_of(r.param) == after:
            r.staged_grad_key = after  # x * 1.0 == x bit for bit (NaN, inf and -0.0 too): the staging is current
        return True

    def _restore(self, bucket: HostBucket, snapshot: _Snapshot) -> None:
        if snapshot.master is not None and bucket.master is not None:
            bucket.master.copy_(snapshot.master)
        for name, flat in snapshot.state.items():
            bucket.state[name].copy_(flat)
        for r in bucket.records:
            r.staged_grad_key = None  # step() copies its grad to the host again
            had_state, step, placeholder = snapshot.records[id(r)]
            if not had_state:
                self._forget(r)  # the redo creates its state as a first update does
                continue
            if step is not None:
                local_tensor(r.created_state["step"]).copy_(step)
            r.placeholder_state = placeholder

    def end_step(self) -> None:
        """Count a step with deferred buckets, free the snapshots, forget the clip's notes."""
        if self._deferred:
            self._count(fallback_steps=1)
        self._deferred.clear()
        self._reserved.clear()
        # The buffers are kept for the next step's snapshots (no allocation, no page faults per step).
        self._buffers = {index: [t for t in (s.master, *s.state.values()) if t is not None]
                         for index, s in self._snapshots.items()}  # fmt: skip
        self._snapshots.clear()
        self._notes.clear()


def _flats(bucket: HostBucket) -> list[torch.Tensor]:
    """The flat buffers a snapshot copies: master first (if any), then the state buffers in their order."""
    return [t for t in (bucket.master, *bucket.state.values()) if t is not None]


def _key_of(param: torch.Tensor) -> Any:
    grad = get_grad(param)
    return grad_key(local_tensor(grad)) if grad is not None else None


def clip_notes(params: Iterable[torch.Tensor]) -> list[tuple[SpeculativeClip, list[torch.Tensor], list[Any]]]:
    """Before a clip scales ``params``' grads: the speculating optimizers among their owners, each with its
    params and their grads' keys now (the arguments of :meth:`SpeculativeClip.note_clip` after the clip)."""
    from offload_fsdp.overlap import speculation_of

    grouped: dict[int, tuple[SpeculativeClip, list[torch.Tensor], list[Any]]] = {}
    for p in params:
        spec = speculation_of(p)
        if spec is not None:
            _, mine, keys = grouped.setdefault(id(spec), (spec, [], []))
            mine.append(p)
            keys.append(_key_of(p))
    return list(grouped.values())
