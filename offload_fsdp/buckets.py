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
from typing import TYPE_CHECKING, NamedTuple

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
    buckets = _group(records, first_index, bucket_numel, master_dtype_of, engine_for)
    layouts = _BufferLayouts()
    handles = [layouts.add_bucket(b, pin, kernel_of) for b in buckets]
    arenas = layouts.allocate()
    for b, (h, hs) in zip(buckets, handles):
        grad_stage, master = arenas.view(h.grad), arenas.view(h.master)
        param_stage = arenas.view(h.param_stage) if h.param_stage is not None else None
        b.grad_stage, b.master, b.param_stage = grad_stage, master, param_stage
        b.state = {name: arenas.view(entry) for name, entry in hs.items()}
        for r in b.records:  # each record's shaped views into the bucket's flat buffers
            sl = slice(r.offset, r.offset + r.numel)
            r.master = master[sl].view(r.local.shape)
            r.grad_stage = grad_stage[sl].view(r.local.shape)
            r.param_stage = param_stage[sl].view(r.local.shape) if param_stage is not None else None
    return buckets, arenas.buffers


_Entry = tuple[HostLayout, int]  # (the layout of an arena, a buffer's handle in it)


class _BucketEntries(NamedTuple):
    grad: _Entry
    master: _Entry
    param_stage: _Entry | None


def _group(
    records: list[ParamShard],
    first_index: int,
    bucket_numel: int,
    master_dtype_of: Callable[[torch.dtype], torch.dtype],
    engine_for: Callable[[torch.device], CopyEngine],
) -> list[HostBucket]:
    """The offloaded ``records``, in order, into buckets of one (group, device, dtypes) of at most ``bucket_numel``."""
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
    return buckets


class _BufferLayouts:
    """Where each bucket's flat buffers go: one pinned arena, and a pageable one per (dtype, role)."""

    def __init__(self) -> None:
        self.pinned = HostLayout()
        self.pageable: dict[tuple[torch.dtype, str], HostLayout] = {}

    def _add(self, pin_it: bool, numel: int, dtype: torch.dtype, role: str) -> _Entry:
        # Nothing in the pinned arena is optimizer state (only staging, and masters that
        # are the params' own dtype), so only the pageable side needs one arena per role.
        layout = self.pinned if pin_it else self.pageable.setdefault((dtype, role), HostLayout())
        return layout, layout.add(numel, dtype)

    def add_bucket(
        self,
        b: HostBucket,
        pin: tuple[bool, bool],
        kernel_of: Callable[[HostBucket], tuple[HostKernel, dict[str, torch.dtype]] | None],
    ) -> tuple[_BucketEntries, dict[str, _Entry]]:
        """Lay out ``b``'s grad staging, param staging, master and (with a kernel, set here) state buffers."""
        pin_grads, pin_params = pin
        separate = b.master_dtype != b.param_dtype
        entries = _BucketEntries(
            grad=self._add(pin_grads, b.numel, b.grad_dtype, "staging"),
            # The H2D source is pinned; a separate fp32 master never crosses the bus.
            param_stage=self._add(pin_params, b.numel, b.param_dtype, "staging") if separate else None,
            master=self._add(pin_params and not separate, b.numel, b.master_dtype, "master"),
        )
        served = kernel_of(b)
        if served is None:
            return entries, {}
        b.kernel, state_dtypes = served
        return entries, {name: self._add(False, b.numel, dtype, "state") for name, dtype in state_dtypes.items()}

    def allocate(self) -> _Arenas:
        return _Arenas(self)


class _Arenas:
    """The allocated arenas of a :class:`_BufferLayouts`; ``view`` turns a layout entry into its tensor."""

    def __init__(self, layouts: _BufferLayouts) -> None:
        self._by_layout = {id(layouts.pinned): layouts.pinned.allocate(pin=True)}
        self._by_layout.update({id(layout): layout.allocate(pin=False) for layout in layouts.pageable.values()})
        self.buffers = HostBuffers(
            pinned=self._by_layout[id(layouts.pinned)],
            pageable={key: self._by_layout[id(layout)] for key, layout in layouts.pageable.items()},
        )

    def view(self, entry: _Entry) -> torch.Tensor:
        layout, handle = entry
        return self._by_layout[id(layout)].view(handle)
