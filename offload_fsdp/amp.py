"""The AMP concern: ``torch.amp.GradScaler``'s protocol for optimizers that handle scaling themselves.

An optimizer with ``_step_supports_amp_scaling = True`` gets ``GradScaler.step`` calling
``step()`` with ``grad_scale`` / ``found_inf`` set on it instead of GradScaler unscaling
and maybe skipping on its own. HybridDeviceOptimizer needs it because GradScaler unscales
with ``torch._amp_foreach_non_finite_check_and_unscale_``, which bumps no version counter:
the backward hooks' host copies of the still-scaled grads would look current to ``step()``
(:meth:`offload_fsdp.transfer.Transfer.stage_grad`'s key). The overlapped schedule uses
the same attributes to refuse GradScaler, or, with ``speculative_clipping``, to redo every bucket.
"""

from __future__ import annotations

from typing import Any

import torch

from offload_fsdp.records import ParamShard

__all__ = ["grad_scaler_in_use", "grad_scaler_skips_step", "refuse_grad_scaler"]


def _scaler_args(optimizer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return getattr(optimizer, "found_inf", None), getattr(optimizer, "grad_scale", None)


def grad_scaler_in_use(optimizer: Any) -> bool:
    """True when ``GradScaler.step`` is calling this ``step()`` (it set ``found_inf`` / ``grad_scale``)."""
    found_inf, grad_scale = _scaler_args(optimizer)
    return found_inf is not None or grad_scale is not None


def grad_scaler_skips_step(optimizer: Any, records: list[ParamShard]) -> bool:
    """GradScaler's part of ``step()`` (after backward): True when it found inf/NaN grads (no update).

    Otherwise the grads are unscaled here in place exactly as ``GradScaler.unscale_``
    does (a multiply by the float32 reciprocal of the scale) unless the user already
    called ``unscale_``; either way every host copy is dropped so step() copies the
    unscaled grads again. Call under ``no_grad``.
    """
    found_inf, grad_scale = _scaler_args(optimizer)
    if found_inf is None and grad_scale is None:
        return False
    for r in records:
        r.staged_grad_key = None  # scaled (or unscaled behind the version counters) since the hooks' copies
    if found_inf is not None and found_inf.item() != 0:
        return True
    if grad_scale is not None:
        inv_scale = grad_scale.double().reciprocal().float().item()  # GradScaler's own reciprocal
        for r in records:
            if r.param.grad is not None:  # GradScaler unscales .grad only
                r.param.grad.mul_(inv_scale)
    return False


def refuse_grad_scaler(optimizer: Any) -> None:
    """``ValueError`` when ``GradScaler.step`` called this step (overlapped schedule): the updates already ran."""
    if grad_scaler_in_use(optimizer):
        optimizer.found_inf = optimizer.grad_scale = None
        raise ValueError(
            "AMP's GradScaler.step is not supported with overlap_step_with_backward=True: the host updates "
            "ran during backward on still-scaled gradients, before GradScaler could unscale them or skip a "
            "step with inf/NaN gradients (the buckets updated so far used them: restore from a checkpoint); build "
            "the optimizer with speculative_clipping=True (each bucket is then restored and redone after "
            "backward), train in bf16 without a GradScaler, or build it without overlap_step_with_backward"
        )
