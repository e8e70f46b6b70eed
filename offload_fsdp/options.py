"""``HybridDeviceOptimizer``'s settings as one documented dataclass, with enums for its modes.

``HybridDeviceOptimizer(params, options=OffloadOptions(...))`` and the keyword form
``HybridDeviceOptimizer(params, offload_fraction, cpu_optimizer_cls=..., ...)`` are the
same: the keywords build an :class:`OffloadOptions` (:meth:`OffloadOptions.from_keywords`).
``$OFFLOAD_FSDP_HOST_STEP`` keeps choosing the host Adam step when ``host_step`` is left
``None``. Every setting is validated here, at construction (``ValueError`` naming it).
"""

from __future__ import annotations

import enum
import math
import numbers
import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch

from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.transfer_ring import check_transfer_slots

__all__ = ["DEFAULT_BUCKET_NUMEL", "HostStepChoice", "OffloadOptions", "Schedule", "check_fraction"]

DEFAULT_BUCKET_NUMEL = 1 << 24
"""16M elements (64 MiB of fp32 master) per bucket: big enough that per-bucket
overheads vanish, small enough that D2H / host step / H2D of neighbouring
buckets overlap."""


class Schedule(enum.Enum):
    """When the host buckets are updated."""

    AFTER_BACKWARD = "after_backward"
    """inside ``step()``, after the whole backward (the default)"""
    OVERLAPPED = "overlapped"
    """during the final backward, each bucket as soon as its grads are final (``overlap_step_with_backward=True``)"""


class HostStepChoice(enum.Enum):
    """How the Adam(W) host kernel steps a bucket (``$OFFLOAD_FSDP_HOST_STEP``: these values)."""

    AUTO = "auto"
    """the compiled C loop, built at the first step that needs it; torch's fused kernel if that fails"""
    COMPILED = "compiled"
    """the compiled loop, built at construction (its cost and any failure warning come then)"""
    FUSED = "fused"
    """torch's fused CPU Adam kernel in cache-sized pieces only"""


def check_fraction(value: Any) -> float:
    """``value`` as a float in [0, 1]; anything else (NaN, non-numbers, bools) is a ValueError.

    Accepted: real numbers (int, float, numpy scalars, ``fractions.Fraction``) and
    one-element real tensors. A bool is refused although Python counts it as an int:
    ``True`` where a fraction belongs is far more likely a misplaced flag than "1.0".
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not (value.is_complex() or value.dtype == torch.bool):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"offload_fraction must be a real number in [0, 1] (a float, int or one-element tensor; not a bool), "
            f"got {value!r} of type {type(value).__name__}"
        )
    value = float(value)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload_fraction must be in [0, 1], got {value!r}")
    return value


@dataclass(kw_only=True)
class OffloadOptions:
    """Everything ``HybridDeviceOptimizer`` is told besides its params, hyper-parameters and ``model``."""

    offload_fraction: float = 1.0
    """share (in [0, 1]) of trainable device-resident local elements whose update runs on the host, as a
    whole-parameter prefix in parameter order (params already on the CPU always update on the host)"""
    cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None
    """class of the host update; None: the wrapped optimizer's class, else ``torch.optim.AdamW``"""
    gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None
    """class of the device update; None: the host class"""
    precision: PrecisionPolicy | None = None
    """master, host moment and grad staging dtypes; None: ``PrecisionPolicy()`` (fp32 masters)"""
    pin_cpu_grads: bool = True
    """page-lock the host grad staging (ignored without an accelerator and with ``pinned_transfer_slots``)"""
    pin_cpu_params: bool = True
    """page-lock the host buffer H2D copies from (ignored as ``pin_cpu_grads``)"""
    overlap_cpu_optimizer_d2h_h2d: bool = True
    """copies on side streams, D2H started from post-accumulate-grad hooks; False: blocking copies in ``step()``.

    With gradient accumulation every micro-batch's backward re-copies the (accumulated) grad, and ``step()``
    re-copies any grad changed in place since (clipping, unscaling: detected by the tensor's version
    counter), so results are always those of the final grad. FSDP2 runs these hooks on the sharded grads
    after its reduce-scatter, so there too each D2H overlaps the rest of backward; the copy is ordered after
    the stream that is current when the hook runs."""
    pinned_transfer_slots: int | None = None
    """None: every host buffer that crosses the bus is page-locked; n >= 1: they stay pageable and copies go
    through n page-locked slots per direction (:mod:`offload_fsdp.transfer_ring`), with the same results.

    Each slot is the size of the largest bucket's grads / params, so pinned memory is n buckets' worth,
    whatever the model size."""
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    """elements per host bucket (the pipelining unit)"""
    graph_safe_grads: bool = False
    """gradients become views of persistent flat buffers a CUDA graph keeps writing (:mod:`offload_fsdp.graph_safe`).

    Every trainable param's gradient is a view of a persistent flat buffer (``main_grads_dtype`` views go to
    ``decoupled_grad``), and ``zero_grad`` zeroes those buffers in place whatever ``set_to_none`` says, so a
    CUDA graph captured over forward + backward keeps writing into the gradients the step reads. Plain
    (local-shard) params only: FSDP2 allocates DTensor gradients itself (``TypeError``). As with any
    persistent gradient, a param left out of a backward is stepped with a zero gradient."""
    schedule: Schedule = Schedule.AFTER_BACKWARD
    """when the host buckets are updated (:class:`Schedule`); ``OVERLAPPED`` needs ``overlap_cpu_optimizer_d2h_h2d``.

    ``OVERLAPPED`` (the keyword ``overlap_step_with_backward=True``): each host bucket's update runs during
    the final backward, on one host worker thread, as soon as all of its params' grads are final and staged
    (in gradient-arrival order; its H2D is queued right after); ``step()`` then waits for what is still
    running and does the rest (buckets not complete during backward, the device share). Results are
    bit-identical to ``AFTER_BACKWARD``. Costs one host thread, and a backward not inside
    ``defer_grad_copies()`` commits to the step. Refused with an error naming the fix: ``step(closure)``,
    AMP's ``GradScaler.step``, ``optim.clip_grad_norm_`` / ``grad_norm`` on these params, a grad changed in
    place after its update started (torch's clipping, unscaling), a second backward reaching a started
    bucket, hyper-parameters changed between backward and ``step()``."""
    host_step: HostStepChoice | None = None
    """the Adam(W) host kernel's step (:class:`HostStepChoice`); None: ``$OFFLOAD_FSDP_HOST_STEP``, else ``AUTO``"""
    speculative_clipping: bool = False
    """overlapped schedule only: snapshot each host bucket before its update during backward, so that
    ``optim.clip_grad_norm_`` (or any edit of the grads before ``step()``) is honoured: the update is committed
    when the grads it used are unchanged (a clip coefficient of 1), else restored and redone in ``step()``
    (:mod:`offload_fsdp.speculative`)"""
    clip_snapshot_bytes: int | None = None
    """host bytes the snapshots of one step may hold (None: no bound); a bucket that does not fit is updated by
    ``step()`` after the clip instead (counted in ``optimizer.speculation_counts``)"""
    bind_host_cores: bool | None = None
    """True: bind the host step's threads to this local rank's own cores (:mod:`offload_fsdp.core_binding`);
    None (default) and False: not bound (binding is opt-in: measured slower on a 16-core host)"""
    offload_state_only: bool = False
    """state-only offload of the device share (every trainable param whose update ``offload_fraction`` leaves
    on the device): it is still updated on the device by ``gpu_optimizer_cls``, bucket by bucket, but its fp32
    masters and optimizer state live in host memory (page-locked) between steps, fetched as grads become final
    and written back after the update (:mod:`offload_fsdp.state_only`); bit-identical to keeping them on the
    device"""
    state_device_bytes: int | None = None
    """``offload_state_only`` only: device bytes its masters + state may hold at once, write-backs in flight
    included (None: no bound; every bucket may be on the device during the step)"""

    def __post_init__(self) -> None:
        self.offload_fraction = check_fraction(self.offload_fraction)
        if self.bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {self.bucket_numel}")
        self.pinned_transfer_slots = check_transfer_slots(self.pinned_transfer_slots)
        self.schedule = Schedule(self.schedule)
        if self.host_step is not None:
            self.host_step = HostStepChoice(self.host_step)
        if self.speculative_clipping and self.schedule is not Schedule.OVERLAPPED:
            raise ValueError(
                "speculative_clipping=True applies to overlap_step_with_backward=True only: the default schedule "
                "updates after backward and honours gradient clipping without snapshots; drop speculative_clipping"
            )
        if self.clip_snapshot_bytes is not None and (
            isinstance(self.clip_snapshot_bytes, bool) or not isinstance(self.clip_snapshot_bytes, int)
            or self.clip_snapshot_bytes < 0
        ):  # fmt: skip
            raise ValueError(f"clip_snapshot_bytes must be None or an int >= 0, got {self.clip_snapshot_bytes!r}")
        self._check_state_only()
        if self.bind_host_cores is not None and not isinstance(self.bind_host_cores, bool):
            raise ValueError(f"bind_host_cores must be None, True or False, got {self.bind_host_cores!r}")
        if self.schedule is Schedule.OVERLAPPED and not self.overlap_cpu_optimizer_d2h_h2d:
            raise ValueError(
                "overlap_step_with_backward=True needs overlap_cpu_optimizer_d2h_h2d=True: the backward hooks "
                "that stage grads are what start the host updates"
            )

    def _check_state_only(self) -> None:
        if not isinstance(self.offload_state_only, bool):
            raise ValueError(f"offload_state_only must be True or False, got {self.offload_state_only!r}")
        budget = self.state_device_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"state_device_bytes must be None or an int >= 0, got {budget!r}")
        if budget is not None and not self.offload_state_only:
            raise ValueError(
                "state_device_bytes bounds the device memory of offload_state_only=True; set offload_state_only=True "
                "or drop state_device_bytes"
            )
        if self.offload_state_only and self.offload_fraction >= 1.0:
            warnings.warn(
                "offload_state_only=True acts on the device share, which offload_fraction=1.0 (the default) leaves "
                "empty: every update runs on the host and nothing is state-only; pass offload_fraction=0.0 to keep "
                "every update on the device with its state parked on the host",
                stacklevel=6,
            )

    @classmethod
    def from_keywords(cls, *, overlap_step_with_backward: bool = False, **keywords: Any) -> OffloadOptions:
        """The options the keyword form of ``HybridDeviceOptimizer`` names (``overlap_step_with_backward``: the schedule)."""
        schedule = Schedule.OVERLAPPED if overlap_step_with_backward else Schedule.AFTER_BACKWARD
        return cls(schedule=schedule, **keywords)

    def changed(self) -> list[str]:
        """Names of the fields not at their defaults."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]

    @staticmethod
    def choose(options: OffloadOptions | None, keywords: OffloadOptions) -> OffloadOptions:
        """``options`` (the ``options=`` argument) or, when None, the object the keywords built; both is a
        ``ValueError`` naming the keywords."""
        if options is None:
            return keywords
        if keywords.changed():
            raise ValueError(
                f"settings {keywords.changed()} were passed as keywords together with options=; set them in the "
                "OffloadOptions instead"
            )
        return options
