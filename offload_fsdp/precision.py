"""Precision policy: which dtype each piece of optimizer-side state is kept in."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

__all__ = ["PrecisionPolicy"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Dtypes of the main (master) params, main grads and Adam state.

    ``None`` for ``main_grads_dtype`` means "follow the main params" (as in
    Megatron-FSDP's ``MixedPrecisionPolicy``); ``resolved_main_grads_dtype`` reads
    the effective dtype. The dtype gradients travel in over collectives is FSDP2's
    own setting (``MixedPrecisionPolicy.reduce_dtype``), not this policy's.
    """

    main_params_dtype: torch.dtype | None = torch.float32
    """dtype of the master copy the update is applied to (the truth; the model param is its cast), for params
    narrower than it; ``None`` = no master: every param is updated in its own dtype. The one master-weight
    setting (:mod:`offload_fsdp.master`)."""

    main_grads_dtype: torch.dtype | None = None
    """dtype gradients are accumulated / reduced into; None = ``main_params_dtype``."""

    exp_avg_dtype: torch.dtype = torch.float32
    """dtype of Adam's first moment (fp32, or bf16 to halve its memory and bytes moved)."""

    exp_avg_sq_dtype: torch.dtype = torch.float32
    """dtype of Adam's second moment (fp32, or bf16)."""

    grad_comm_dtype: torch.dtype | None = None
    """Deprecated, read by nothing: kept so the documented constructor keeps working. Gradients travel
    over collectives in FSDP2's ``MixedPrecisionPolicy.reduce_dtype``; setting this warns."""

    def __post_init__(self) -> None:
        if self.grad_comm_dtype is not None:
            warnings.warn(
                f"PrecisionPolicy.grad_comm_dtype={self.grad_comm_dtype} has no effect (nothing in offload-fsdp "
                "reads it) and is deprecated; set the reduce dtype on FSDP2 instead: "
                "fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=...))",
                DeprecationWarning,
                stacklevel=3,
            )
        for name in ("main_params_dtype", "main_grads_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"PrecisionPolicy.{name}={value!r} is not a floating dtype; "
                    f"use one of {', '.join(map(str, _FLOAT_DTYPES))}"
                )
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(self, name)
            if value not in _STATE_DTYPES:
                raise ValueError(
                    f"PrecisionPolicy.{name}={value!r} is not supported; "
                    "optimizer state is kept in torch.float32 or torch.bfloat16"
                )
        if self.main_params_dtype not in (None, torch.float32, torch.float64):
            # A low-precision master loses small updates (lr * update << ulp(param)).
            raise ValueError(
                f"PrecisionPolicy.main_params_dtype={self.main_params_dtype} would make the master "
                "copy low precision and silently drop small updates; use torch.float32 (or None: no master)"
            )

    @property
    def resolved_main_grads_dtype(self) -> torch.dtype | None:
        """``main_grads_dtype``, else ``main_params_dtype``; None (no master, unset) = each param's own dtype."""
        return self.main_grads_dtype if self.main_grads_dtype is not None else self.main_params_dtype

    def grad_staging_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """dtype an offloaded param's gradient is staged in on the host (``HybridDeviceOptimizer``).

        ``main_grads_dtype`` when set, else the param's own dtype: gradients cross the
        bus in the dtype backward produced them in (a bf16 ``.grad`` travels as 2 bytes),
        not in the resolved main-grads dtype, which only a training loop that keeps
        fp32 ``decoupled_grad`` produces (set ``main_grads_dtype`` explicitly then).
        """
        return self.main_grads_dtype if self.main_grads_dtype is not None else param_dtype
