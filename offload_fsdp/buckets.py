"""Host buckets: flat per-bucket storage for the offloaded records' masters, grads and state.

A bucket is a run of offloaded records (in parameter order) that share a param
group, a device, a param dtype and a grad dtype, capped at ``bucket_numel``
elements. Each bucket owns flat buffers; each record's tensors are views of
them at ``record.offset``. Buckets are the pipelining unit: the host steps
bucket *b* while bucket *b+1*'s grads are still arriving and bucket *b-1*'s
params are already travelling back.

Which buffers are page-locked: only what crosses the bus (grad staging, and the
buffer H2D copies from). The fp32 master of a low-precision param and the optimizer
state never leave the host, so they stay pageable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from offload_fsdp.host_memory import HostArena, HostLayout
from offload_fsdp.records import ParamShard

if TYPE_CHECKING:
    from offload_fsdp.copy_engine import CopyEngine
    from offload_fsdp.delegate import DelegatedOptimizer
    from offload_fsdp.host_kernels import HostKernel

__all__ = ["HostBucket", "HostBuffers", "build_buckets"]


@dataclass(eq=False, kw_only=True)
class HostBucket:
    """Flat host storage and pipeline events for a run of offloaded records."""

    index: int
    group_index: int
    device: torch.device
    param_dtype: torch.dtype
    master_dtype: torch.dtype
    grad_dtype: torch.dtype
    records: list[ParamShard]
    numel: int
    engine: CopyEngine
    master: torch.Tensor | None = None
    param_stage: torch.Tensor | None = None
    grad_stage: torch.Tensor | None = None
    kernel: HostKernel | None = None
    """the host kernel that steps this bucket (:mod:`offload_fsdp.host_kernels`); None: ``delegate`` does"""
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    """kernel buckets only: flat state buffers by torch state name, as the kernel's ``state_layout`` says
    (``exp_avg``, ``exp_avg_sq`` for Adam; ``momentum_buffer`` for SGD with momentum)"""
    delegate: DelegatedOptimizer | None = None
    """buckets without a kernel: one ``cpu_optimizer_cls`` instance over this bucket's master views"""
    d2h_done: torch.Event | None = None
    d2h_sources: list[torch.Tensor] = field(default_factory=list)
    """device grads an in-flight D2H reads, held alive on backends without ``record_stream``"""
    h2d_done: torch.Event | None = None


@dataclass
class HostBuffers:
    """The arenas behind all buckets (kept so their memory lives as long as the optimizer)."""

    pinned: HostArena
    pageable: dict[tuple[torch.dtype, str], HostArena]
    """one arena per (dtype, role: "staging", "master" or "state"): views of one storage in
    several dtypes make ``torch.save`` of the state dict fail ("view the same data as
    different types"), and ``torch.save`` writes a view's whole storage, so what the state
    dict holds (moments, a separate master) shares no storage with what it does not (grad
    staging), which would otherwise be written too (twice the file for fp32 params)"""

    @property
    def pageable_reserved_bytes(self) -> int:
        return sum(a.reserved_bytes for a in self.pageable.values())


def _bucket_key(record: ParamShard) -> tuple:
    return (record.group_index, record.local.device, record.param.dtype, record.grad_dtype)


def build_buckets(
    records: list[ParamShard],
    *,
    first_index: int = 0,
    bucket_numel: int,
    master_dtype_of: Callable[[torch.dtype], torch.dtype],
    kernel_of: Callable[[HostBucket], tuple[HostKernel, dict[str, torch.dtype]] | None],
    pin: tuple[bool, bool],
    engine_for: Callable[[torch.device], CopyEngine],
) -> tuple[list[HostBucket], HostBuffers]:
    """Group offloaded ``records`` into buckets, allocate their flat buffers once, fill the views.

    ``master_dtype_of`` maps a param dtype to its host master dtype; ``kernel_of`` gives
    the host kernel that steps a bucket and its flat state buffers' names and dtypes
    (None: a delegated optimizer steps it and keeps its own state). ``pin`` = (pin grads, pin params).
    Buckets are numbered from ``first_index`` (a group added later continues the
    optimizer's numbering); the arenas are new and hold only these buckets. Side effect: sets each
    bucket's ``kernel`` and each record's ``bucket``/``offset``/``master``/``param_stage``/``grad_stage``. Masters and
    staging are NOT initialised from the params here (the caller fetches them).
    """
    buckets: list[HostBucket] = []
    for record in (r for r in records if r.offloaded):
        assert record.grad_dtype is not None  # chosen for every offloaded record before bucketing
        key = _bucket_key(record)
        last = buckets[-1] if buckets else None
        if (
            last is None
            or _bucket_key(last.records[0]) != key
            or (last.numel and last.numel + record.numel > bucket_numel)
        ):
            last = HostBucket(
                index=first_index + len(buckets), group_index=record.group_index, device=record.local.device,
                param_dtype=record.param.dtype, master_dtype=master_dtype_of(record.param.dtype),
                grad_dtype=record.grad_dtype, records=[], numel=0, engine=engine_for(record.local.device),
            )  # fmt: skip
            buckets.append(last)
        record.bucket, record.offset = last, last.numel
        last.records.append(record)
        last.numel += record.numel

    pin_grads, pin_params = pin
    pinned = HostLayout()
    pageable: dict[tuple[torch.dtype, str], HostLayout] = {}

    def add(pin_it: bool, numel: int, dtype: torch.dtype, role: str) -> tuple[HostLayout, int]:
        # Nothing in the pinned arena is optimizer state (only staging, and masters that
        # are the params' own dtype), so only the pageable side needs one arena per role.
        layout = pinned if pin_it else pageable.setdefault((dtype, role), HostLayout())
        return layout, layout.add(numel, dtype)

    handles = []
    state_handles: list[dict[str, tuple[HostLayout, int]]] = []
    for b in buckets:
        separate = b.master_dtype != b.param_dtype
        h: dict[str, tuple[HostLayout, int] | None] = {"grad": add(pin_grads, b.numel, b.grad_dtype, "staging")}
        # The H2D source is pinned; a separate fp32 master never crosses the bus.
        h["param_stage"] = add(pin_params, b.numel, b.param_dtype, "staging") if separate else None
        h["master"] = add(pin_params and not separate, b.numel, b.master_dtype, "master")
        served = kernel_of(b)
        state_h = {}
        if served is not None:
            b.kernel, state_dtypes = served
            state_h = {name: add(False, b.numel, dtype, "state") for name, dtype in state_dtypes.items()}
        handles.append(h)
        state_handles.append(state_h)

    arenas = {id(pinned): pinned.allocate(pin=True)}
    arenas.update({id(layout): layout.allocate(pin=False) for layout in pageable.values()})

    def view(entry):
        layout, handle = entry
        return arenas[id(layout)].view(handle)

    for b, h, hs in zip(buckets, handles, state_handles):
        b.grad_stage = view(h["grad"])
        b.master = view(h["master"])
        b.param_stage = view(h["param_stage"]) if h["param_stage"] is not None else None
        b.state = {name: view(entry) for name, entry in hs.items()}
        for r in b.records:
            sl = slice(r.offset, r.offset + r.numel)
            shape = r.local.shape
            r.master = b.master[sl].view(shape)
            r.grad_stage = b.grad_stage[sl].view(shape)
            r.param_stage = b.param_stage[sl].view(shape) if b.param_stage is not None else None
    return buckets, HostBuffers(
        pinned=arenas[id(pinned)], pageable={key: arenas[id(layout)] for key, layout in pageable.items()}
    )
