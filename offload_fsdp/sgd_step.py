"""The host SGD step over a whole bucket, with torch's fused CPU SGD kernel, in cache-sized pieces.

Results are those of ``torch.optim.SGD(fused=True)`` bit for bit (the same kernel,
through its public functional entry ``torch.optim.sgd.sgd(..., fused=True)``), with
the momentum buffer as flat bucket state. As torch does, a param's first update
starts its ``momentum_buffer`` from the gradient (weight decay and ``maximize``
applied) rather than from zeros, and dampening applies from the second update on.
A buffer that holds no update yet (``ParamShard.placeholder_state``: fresh, or made
by ``materialize_state`` and not loaded) takes that first-update path.

Masters are fp32 (:class:`offload_fsdp.host_kernels.SgdKernel` says why).
When the grad is already in the master's dtype and no param staging is needed, the
bucket is one kernel call over per-record views. Otherwise the bucket is walked in
cache-sized pieces (:func:`unit_pieces`): the grad is cast into a small reusable scratch
(exact for bf16 -> fp32), the kernel updates the master, and the param staging
takes the master's cast in the same pass over the cached piece. A record split
between pieces is cut only where torch's kernel would cut it itself
(:data:`SPLIT_UNIT`), so the bits stay those of one call over the whole param.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.sgd import sgd

from offload_fsdp.fused_step import PieceScratch
from offload_fsdp.records import ParamShard

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket

__all__ = ["SPLIT_UNIT", "SgdHyper", "sgd_bucket_step", "unit_pieces"]

SPLIT_UNIT = 64
"""A record is split between pieces only at multiples of this many elements from its start. torch's
fused CPU SGD kernel walks a tensor in cache-line units (16 fp32) of whole vectors and runs its scalar
tail, whose results differ from the vector body's in the last bit, only at the tensor's end; a cut
elsewhere would put a tail mid-param and change last bits against ``SGD(fused=True)`` on the whole
param (``tests/test_offload_host_kernels.py`` fails with a unit of 1)."""


@dataclass(frozen=True)
class SgdHyper:
    """Hyper-parameters of one SGD group, read fresh from ``param_groups`` each step."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> SgdHyper:
        return cls(
            lr=float(group["lr"]), momentum=float(group["momentum"]), dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
            maximize=bool(group.get("maximize", False)),
        )  # fmt: skip


Segment = tuple[int, int, ParamShard]
"""(begin, end, record): a record's elements ``[begin, end)`` within the flat tensors passed along"""


def unit_pieces(active: list[ParamShard], numel: int) -> Iterator[tuple[int, int, list[Segment]]]:
    """(start, stop, segments) of consecutive bucket ranges of at most ``numel`` elements covering ``active``.

    ``active`` is sorted by offset; ``numel`` is a multiple of :data:`SPLIT_UNIT`. A record
    crossing a piece's end is cut at the last multiple of ``SPLIT_UNIT`` (from its start)
    before it, or, when that is its start, left whole to the next piece.
    """
    spans = [(r.offset, r.offset + n, r) for r in active if (n := r.numel)]  # numel is a property, not free
    i, start = 0, 0
    while i < len(spans):
        start = max(start, spans[i][0])
        stop, segs = start + numel, []
        while i < len(spans):
            begin, end, r = spans[i]
            lo = max(begin, start)
            if end <= stop:
                segs.append((lo, end, r))
                i += 1
                continue
            if begin < stop:
                cut = begin + (stop - begin) // SPLIT_UNIT * SPLIT_UNIT
                if cut > lo:
                    segs.append((lo, cut, r))  # the rest of it starts the next piece
            break
        stop = segs[-1][1]  # never past the data: the next piece starts at the next active element
        yield start, stop, segs
        start = stop


def _kernel(hyper: SgdHyper, params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list) -> None:
    sgd(
        params, grads, bufs, fused=True, weight_decay=hyper.weight_decay, momentum=hyper.momentum, lr=hyper.lr,
        dampening=hyper.dampening, nesterov=hyper.nesterov, maximize=hyper.maximize,
    )  # fmt: skip


def _update(
    hyper: SgdHyper, master: torch.Tensor, grads: torch.Tensor, bufs: torch.Tensor | None, segs: list[Segment]
) -> None:
    """One SGD update of ``segs`` of the flat ``master`` / ``grads`` / momentum ``bufs`` (same dtype)."""
    if bufs is None:  # no momentum: torch passes no buffers either
        _kernel(hyper, [master[b:e] for b, e, _ in segs], [grads[b:e] for b, e, _ in segs], [])
        return
    stepped = [s for s in segs if not s[2].placeholder_state]
    if stepped:
        _kernel(
            hyper, [master[b:e] for b, e, _ in stepped], [grads[b:e] for b, e, _ in stepped],
            [bufs[b:e] for b, e, _ in stepped],
        )  # fmt: skip
    first = [s for s in segs if s[2].placeholder_state]
    if first:
        # All-None buffers select the kernel's first-step path (buffer := grad, no dampening);
        # it allocates them, and they are copied into the bucket's flat state.
        fresh: list[torch.Tensor | None] = [None] * len(first)
        _kernel(hyper, [master[b:e] for b, e, _ in first], [grads[b:e] for b, e, _ in first], fresh)
        for (b, e, _), buf in zip(first, fresh):
            assert buf is not None  # created by the first-step path
            bufs[b:e].copy_(buf)


@torch.no_grad()
def sgd_bucket_step(bucket: HostBucket, active: list[ParamShard], hyper: SgdHyper, scratch: PieceScratch) -> None:
    """One SGD update of the ``active`` records of ``bucket`` (preconditions: ``HostKernel.step_bucket``).

    Side effects: masters, momentum buffers, ``placeholder_state`` and param staging of the active records.
    """
    master, stage, grads = bucket.master, bucket.param_stage, bucket.grad_stage
    assert master is not None and grads is not None  # allocated with the bucket
    bufs = bucket.state.get("momentum_buffer") if hyper.momentum != 0 else None
    assert hyper.momentum == 0 or bufs is not None, "the optimizer refuses momentum without a buffer"
    active = sorted(active, key=lambda r: r.offset)
    if stage is None and grads.dtype == master.dtype:  # nothing to cast: whole records, one call
        segs = [(r.offset, r.offset + n, r) for r in active if (n := r.numel)]  # numel is a property, not free
        if segs:
            _update(hyper, master, grads, bufs, segs)
        _mark_real(active, bufs)
        return
    if scratch.numel < SPLIT_UNIT:
        raise ValueError(f"host step scratch of {scratch.numel} elements is below SGD's split unit {SPLIT_UNIT}")
    for start, stop, piece_segs in unit_pieces(active, scratch.numel // SPLIT_UNIT * SPLIT_UNIT):
        g = grads[start:stop]
        if g.dtype != master.dtype:
            g = scratch.get(f"sgd_grad_{master.dtype}", master.dtype)[: stop - start]
            g.copy_(grads[start:stop])  # the grad as the master's dtype, as torch steps an fp32 master
        local = [(b - start, e - start, r) for b, e, r in piece_segs]
        _update(hyper, master[start:stop], g, bufs[start:stop] if bufs is not None else None, local)
        if stage is not None:
            # Whole pieces: an inactive record's staging already is its master's cast.
            stage[start:stop].copy_(master[start:stop])
    _mark_real(active, bufs)


def _mark_real(active: list[ParamShard], bufs: torch.Tensor | None) -> None:
    """Clear ``placeholder_state`` of records whose buffer this update wrote (after all their pieces).

    Not without momentum: torch then keeps no buffer, so a later step with momentum starts it from the grad.
    """
    if bufs is not None:
        for r in active:
            r.placeholder_state = False
