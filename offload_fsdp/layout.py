"""``HybridDeviceOptimizer.layout()``: a read-only picture of where each parameter's update runs.

For users who want to see what construction decided (which params are updated on
the host, how they were bucketed, which host kernel steps a bucket, which copy
engine moves its bytes, how much host memory each arena holds) without reaching
into the optimizer. A snapshot: plain values, no tensors, nothing that changes the
optimizer when changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload_fsdp.buckets import HostBucket, HostBuffers
from offload_fsdp.host_memory import HostArena
from offload_fsdp.records import ParamShard

__all__ = ["ArenaLayout", "BucketLayout", "OffloadLayout", "ParamLayout", "StateOnlyBucketLayout", "describe"]


@dataclass(frozen=True)
class ParamLayout:
    """One parameter, in ``param_groups`` order."""

    name: str
    """its FQN when the groups carry ``param_names``, else ``param_groups[g][i]``"""
    group_index: int
    trainable: bool
    """``requires_grad`` at construction (only these get update space)"""
    offloaded: bool
    """its update runs on the host (master, grad staging and state in a host bucket)"""
    bucket: int | None
    """index of its host bucket (offloaded params only)"""
    state_only_bucket: int | None = None
    """index of its state-only bucket (``offload_state_only``: updated on the device, its master and state
    parked on the host between steps); None for every other param"""


@dataclass(frozen=True)
class BucketLayout:
    """One host bucket: a run of offloaded params updated together (the pipelining unit)."""

    index: int
    group_index: int
    device: torch.device
    """the device of its params"""
    params: tuple[str, ...]
    """names of its params, in bucket order"""
    numel: int
    param_dtype: torch.dtype
    master_dtype: torch.dtype
    grad_dtype: torch.dtype
    """dtype of its host grad staging (the grads' own dtype)"""
    param_staging: bool
    """True when a separate param-dtype buffer holds the master's cast for the H2D (low-precision params)"""
    kernel: str | None
    """name of the host kernel stepping it (``HostKernel.name``); None: one ``cpu_optimizer_cls`` instance does"""
    state_dtypes: tuple[tuple[str, torch.dtype], ...]
    """the kernel's flat state buffers (torch's state names, dtypes); empty for a delegated bucket"""
    copy_engine: str
    """the class name of the copy engine moving its grads and params"""
    pinned: bool
    """its grad staging is page-locked"""


@dataclass(frozen=True)
class StateOnlyBucketLayout:
    """One state-only bucket: a run of device-share params updated by one device optimizer, whose masters
    and state are parked on the host between steps (:mod:`offload_fsdp.state_only`)."""

    index: int
    group_index: int
    device: torch.device
    """the device of its params (where its update runs)"""
    params: tuple[str, ...]
    """names of its params, in bucket order"""
    numel: int
    host_bytes: int
    """bytes of its host buffers (one allocation, alignment included): what a fetch moves and holds on the
    device, once its state exists (masters only before its first update)"""
    pinned: bool
    """its host buffers are page-locked (on an accelerator)"""


@dataclass(frozen=True)
class ArenaLayout:
    """One host allocation behind the buckets' buffers."""

    role: str
    """``"pinned"`` (what crosses the bus, unless ``pinned_transfer_slots``), else ``"<dtype> <role>"`` with role
    ``staging``, ``master`` or ``state``"""
    pinned: bool
    """page-locked (a ``"pinned"`` arena may fall back to pageable memory)"""
    buffer_numels: tuple[int, ...]
    """one entry per buffer, in allocation order"""
    used_bytes: int
    reserved_bytes: int
    """used bytes plus alignment padding"""
    allocated_bytes: int
    """bytes of the allocation itself"""


@dataclass(frozen=True)
class OffloadLayout:
    """What :meth:`HybridDeviceOptimizer.layout` returns."""

    params: tuple[ParamLayout, ...]
    buckets: tuple[BucketLayout, ...]
    arenas: tuple[ArenaLayout, ...]
    """every arena, construction's first, then those of groups added later"""
    state_only_buckets: tuple[StateOnlyBucketLayout, ...] = ()
    """the state-only buckets (``offload_state_only=True``), in order; empty otherwise"""

    @property
    def offloaded(self) -> tuple[bool, ...]:
        """``offloaded`` of each param, in ``param_groups`` order."""
        return tuple(p.offloaded for p in self.params)


def _param(r: ParamShard) -> ParamLayout:
    return ParamLayout(
        r.name,
        r.group_index,
        r.trainable,
        r.offloaded,
        r.host_bucket.index if r.offloaded else None,
        r.parked.index if r.parked is not None else None,
    )


def _state_only_buckets(records: list[ParamShard]) -> tuple[StateOnlyBucketLayout, ...]:
    parked = {id(r.parked): r.parked for r in records if r.parked is not None}  # each bucket once, in order
    return tuple(
        StateOnlyBucketLayout(
            index=b.index,
            group_index=b.records[0].group_index,
            device=b.parking.device,
            params=tuple(r.name for r in b.records),
            numel=sum(r.numel for r in b.records),
            host_bytes=b.host.nbytes if b.host is not None else 0,
            pinned=b.host is not None and b.host.arena.pinned,
        )
        for b in parked.values()
    )


def _bucket(b: HostBucket) -> BucketLayout:
    assert b.grad_stage is not None
    return BucketLayout(
        index=b.index,
        group_index=b.group_index,
        device=b.device,
        params=tuple(r.name for r in b.records),
        numel=b.numel,
        param_dtype=b.param_dtype,
        master_dtype=b.master_dtype,
        grad_dtype=b.grad_dtype,
        param_staging=b.param_stage is not None,
        kernel=b.kernel.name if b.kernel is not None else None,
        state_dtypes=tuple((name, t.dtype) for name, t in b.state.items()),
        copy_engine=type(b.engine).__name__,
        pinned=b.grad_stage.is_pinned(),
    )


def _arena(role: str, a: HostArena) -> ArenaLayout:
    return ArenaLayout(
        role=role,
        pinned=a.pinned,
        buffer_numels=tuple(n for n, _, _ in a.layout.requests),
        used_bytes=a.layout.used_bytes,
        reserved_bytes=a.reserved_bytes,
        allocated_bytes=a.storage.untyped_storage().nbytes(),
    )


def describe(records: list[ParamShard], buckets: list[HostBucket], buffers: list[HostBuffers]) -> OffloadLayout:
    arenas = [
        arena
        for b in buffers
        for arena in (
            _arena("pinned", b.pinned),
            *(_arena(f"{dtype} {role}", a) for (dtype, role), a in b.pageable.items()),
        )
    ]
    return OffloadLayout(
        tuple(_param(r) for r in records),
        tuple(_bucket(b) for b in buckets),
        tuple(arenas),
        _state_only_buckets(records),
    )
