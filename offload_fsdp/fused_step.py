"""The host Adam/AdamW step over a whole bucket, in cache-sized pieces.

Memory traffic is the cost of a host optimizer step (about 28 bytes per fp32
parameter), so every cast is folded into the same pass instead of running as a
separate sweep over the bucket: the bucket's flat range is walked in pieces of
``PIECE_NUMEL`` elements; for each piece, whatever is not fp32 (a bf16 grad, bf16
moments, a bf16 master when ``param_update_in_fp32=False``) is upcast into a
small reusable fp32 scratch that stays in cache, torch's fused Adam(W) kernel
runs on the piece, and the results are cast back (params into the bf16 staging
buffer H2D copies from). One kernel call per piece, covering every record in it.

Records without a gradient this step are left out of the kernel call (no update,
no weight decay, no step count), exactly like torch skips params whose grad is None.

bf16 moments with a slow decay are written back with *stochastic* rounding: with round-to-nearest,
``exp_avg_sq * 0.999`` rounds back to ``exp_avg_sq`` (the change is below half a
bf16 ulp), so the second moment would stop decaying. The rounding noise is
counter-based, not drawn from a generator: a window, at an offset derived from
(step, piece position, moment), into a fixed table of uniform 16-bit values. It
is a pure function of the state, so resume stays bit-exact, and costs no extra
kernel to generate.

When nothing needs a cast (fp32 params, grads and moments) the whole bucket is
one kernel call over per-record views: there is nothing to fold, and piecing
would only add per-call overhead.

:mod:`offload_fsdp.compiled_step` (the default where a C compiler is found; this module is its fallback) does
the same update as one C pass per piece, with bit-identical results: it relies on
this module's piece grid (:func:`pieces`) and noise counters (:func:`noise_counter`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam

from offload_fsdp.buckets import HostBucket
from offload_fsdp.records import ParamShard

__all__ = ["AdamHyper", "PieceScratch", "PIECE_NUMEL", "adam_bucket_step", "fused_adam", "noise_counter", "pieces"]

PIECE_NUMEL = 1 << 19
"""Elements per piece: 512K x 4 fp32 streams (param, grad, 2 moments) = 8 MiB, split across the
kernel's threads, so each thread's share stays in its L2/L3 between the upcast, the update and the
downcast. Smaller pieces measured slower on a 2-core host (per-piece dispatch of ~10 small ops
outweighs the cache gain: 2^16 was 2x slower than 2^19 for bf16 params)."""


@dataclass(frozen=True)
class AdamHyper:
    """Scalar hyper-parameters of one Adam/AdamW group, read fresh from ``param_groups`` each step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    decoupled: bool

    @classmethod
    def from_group(cls, group: dict[str, Any], *, decoupled_default: bool) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]), maximize=bool(group.get("maximize", False)),
            decoupled=bool(group.get("decoupled_weight_decay", decoupled_default)),
        )  # fmt: skip


_GOLDEN = 40503  # round(65536 / golden ratio): spreads successive counters over the table
_NOISE_SPAN = 1 << 16
_SR_BELOW = 1.0 / 64
"""Stochastic rounding for a moment whose per-step decay 1-beta is below this (beta2=0.999, beta1=0.99):
smaller relative changes are lost or biased by round-to-nearest in bf16 (8 mantissa bits). For
beta1=0.9 the 10% change per step is well resolved and the cheaper plain cast is used."""


class PieceScratch:
    """fp32 scratch pieces and the rounding-noise table, reused by every bucket (allocated once, lazily)."""

    def __init__(self, numel: int = PIECE_NUMEL) -> None:
        self.numel = numel
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if name not in self._buffers:
            self._buffers[name] = torch.empty(self.numel, dtype=dtype)
        return self._buffers[name]

    def noise(self, n: int, counter: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """``n`` uniform 16-bit values for ``counter``: a window into a fixed random table.

        ``dtype`` int32 (what the bit arithmetic of :func:`_stochastic_round_into` adds) or
        uint16: the same values at the same offsets in half the bytes, for the compiled
        step, whose memory traffic they add to.
        """
        if "table" not in self._buffers:
            gen = torch.Generator().manual_seed(0x5EED)  # fixed: the noise must not depend on global RNG state
            self._buffers["table"] = torch.randint(
                0, 1 << 16, (self.numel + _NOISE_SPAN,), dtype=torch.int32, generator=gen
            )
        if dtype == torch.uint16 and "table16" not in self._buffers:
            self._buffers["table16"] = self._buffers["table"].to(torch.uint16)  # exact: every value is below 2**16
        offset = noise_offset(counter)
        return self._buffers["table16" if dtype == torch.uint16 else "table"][offset : offset + n]


def noise_offset(counter: int) -> int:
    """Where the noise window of ``counter`` starts in the table (:meth:`PieceScratch.noise`)."""
    return (counter * _GOLDEN) % _NOISE_SPAN


def _as_fp32(flat: torch.Tensor, start: int, stop: int, scratch: PieceScratch, name: str) -> torch.Tensor:
    """fp32 view of ``flat[start:stop]``: the buffer itself if fp32, else an upcast copy in scratch."""
    if flat.dtype == torch.float32:
        return flat[start:stop]
    out = scratch.get(name)[: stop - start]
    out.copy_(flat[start:stop])
    return out


def _stochastic_round_into(dst: torch.Tensor, src: torch.Tensor, noise: torch.Tensor) -> None:
    """``dst`` (bf16) <- ``src`` (fp32, clobbered) rounded stochastically with 16-bit ``noise``."""
    bits = src.view(torch.int32)
    # Adding a uniform 16-bit value to the magnitude bits then truncating rounds up
    # with probability equal to the dropped fraction (works for either sign).
    bits.add_(noise).bitwise_and_(-65536)
    dst.copy_(src)  # exact: the low 16 bits are zero now


def noise_counter(step: int, start: int, scratch: PieceScratch) -> int:
    """Rounding-noise counter of the piece at ``start`` whose first active record is at step ``step``.

    (step, piece position in the bucket) -> distinct, reproducible noise; the two
    moments add a salt of 0 and 1. Shared with :mod:`offload_fsdp.compiled_step`,
    which must pick the same windows to stay bit-identical.
    """
    return step * 7919 + start // scratch.numel * 104729


def pieces(active: list[ParamShard], numel: int) -> Iterator[tuple[int, int, list[tuple[int, int, ParamShard]]]]:
    """(start, stop, segments) of each piece holding active elements, segments being (begin, end, record).

    ``active`` is sorted by offset. Pieces are ``numel`` long from the first active
    record's offset (the grid the rounding-noise counters are tied to). One sweep
    over the records: ``ParamShard.numel`` is not free, and a bucket holds
    hundreds of records and pieces.
    """
    if not active:
        return
    spans = [(r.offset, r.offset + r.numel, r) for r in active]
    lo, hi = active[0].offset, max(e for _, e, _ in spans)
    first = 0
    for start in range(lo, hi, numel):
        stop = min(start + numel, hi)
        while first < len(spans) and spans[first][1] <= start:
            first += 1
        segs = []
        for b, e, r in itertools.islice(spans, first, None):
            if b >= stop:
                break
            if max(start, b) < min(stop, e):
                segs.append((max(start, b), min(stop, e), r))
        if segs:
            yield start, stop, segs


def fused_adam(hyper: AdamHyper, tensors: Iterable[list[torch.Tensor]], steps: list[torch.Tensor]) -> None:
    """torch's fused Adam(W) kernel on ``tensors`` (the param, grad, exp_avg and exp_avg_sq lists) at ``steps``.

    Through the public ``torch.optim.adam.adam(..., fused=True)``, which increments the
    step tensors it is given before the update: it gets fresh copies one below ``steps``
    (the records' own counters, already incremented once for this step, since a record
    split between pieces is passed to several calls). Exact: steps are small integers.
    """
    p, g, m, v = tensors
    before = list(torch.stack(steps).sub_(1.0).unbind()) if steps else []
    adam(
        p, g, m, v, [], before, fused=True, amsgrad=False, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
        weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=hyper.maximize,
        decoupled_weight_decay=hyper.decoupled,
    )  # fmt: skip


@torch.no_grad()
def adam_bucket_step(bucket: HostBucket, active: list[ParamShard], hyper: AdamHyper, scratch: PieceScratch) -> None:
    """One Adam/AdamW update of ``active`` records of ``bucket`` (their ``step`` already incremented).

    Preconditions: staged grads have landed (``wait_grads``), the previous H2D no
    longer reads the bucket (``wait_params_free``), every active record has
    exposed state. Side effects: master, moments and param staging of the active
    records are updated in place.
    """
    active = sorted(active, key=lambda r: r.offset)
    m_flat, v_flat = bucket.state["exp_avg"], bucket.state["exp_avg_sq"]
    master, stage, grads = bucket.master, bucket.param_stage, bucket.grad_stage
    assert master is not None and grads is not None  # allocated with the bucket
    flats = (master, grads, m_flat, v_flat)
    if stage is None and all(t.dtype == torch.float32 for t in flats):
        nonempty = [(r, n) for r in active if (n := r.numel)]  # numel is a property, not free
        if nonempty:
            spans = [slice(r.offset, r.offset + n) for r, n in nonempty]
            fused_adam(hyper, ([t[s] for s in spans] for t in flats), [r.created_state["step"] for r, _ in nonempty])
        return
    for start, stop, segs in pieces(active, scratch.numel):
        p = _as_fp32(master, start, stop, scratch, "param")
        g = _as_fp32(grads, start, stop, scratch, "grad")
        m = _as_fp32(m_flat, start, stop, scratch, "exp_avg")
        v = _as_fp32(v_flat, start, stop, scratch, "exp_avg_sq")
        views = [slice(b - start, e - start) for b, e, _ in segs]
        fused_adam(hyper, ([t[s] for s in views] for t in (p, g, m, v)), [r.created_state["step"] for _, _, r in segs])
        # Cast back whole pieces: records without a grad in the piece are unchanged,
        # and a cast of an unchanged exact upcast is the identity.
        if master.dtype != torch.float32:
            master[start:stop].copy_(p)
        if m_flat.dtype != torch.float32 or v_flat.dtype != torch.float32:
            counter = noise_counter(int(segs[0][2].created_state["step"]), start, scratch)
            for flat, fp32, beta, salt in ((m_flat, m, hyper.beta1, 0), (v_flat, v, hyper.beta2, 1)):
                if flat.dtype == torch.float32:
                    continue
                if 1.0 - beta < _SR_BELOW:
                    _stochastic_round_into(flat[start:stop], fp32, scratch.noise(stop - start, counter + salt))
                else:
                    flat[start:stop].copy_(fp32)  # a decay this strong survives round-to-nearest
        if stage is not None:
            stage[start:stop].copy_(p)
