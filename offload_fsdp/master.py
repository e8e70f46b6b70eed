"""The master weight: the one place that says which params get one, in what dtype, under what key.

A parameter narrower than ``PrecisionPolicy.main_params_dtype`` (bf16 / fp16
params under the default fp32) is updated through a *master*: a copy in the
wider dtype that is the truth, the parameter being its cast. Every optimizer
path of this toolkit takes these facts from here:

* ``HybridDeviceOptimizer`` (host masters in flat buckets, device fp32 masters
  for the device share);
* :func:`optim.enable_main_params` (a stock ``torch.optim`` optimizer stepping
  master copies through its step hooks);
* ``optim.build_optimizer``'s TE / apex ``master_weights`` (their own masters,
  turned on exactly when :func:`has_master` says a param needs one).

One setting: ``PrecisionPolicy.main_params_dtype`` (``None``: no master, every
param is updated in its own dtype). One state key: :data:`MASTER_KEY`; state
saved under the old key of ``enable_main_params`` (``"main_param"``) loads as
the same thing (:func:`canonical_state`).

The user's weights are the truth: a param written since the optimizer last
made it agree with its master is *adopted* (:func:`adopt_written`), so a stale
master never reverts a load or an in-place edit.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch

from offload_fsdp.precision import PrecisionPolicy

__all__ = [
    "LEGACY_MASTER_KEYS",
    "MASTER_KEY",
    "adopt_written",
    "canonical_state",
    "has_master",
    "master_dtype",
    "policy_with_fp32_update",
]

MASTER_KEY = "master_param"
"""The optimizer-state key of a master weight (and ``optimizer.state.<fqn>.master_param`` in a checkpoint)."""

LEGACY_MASTER_KEYS = ("main_param",)
"""Keys older versions saved a master under (``optim.enable_main_params`` before 2026-11); loaded as ``MASTER_KEY``."""


def master_dtype(param_dtype: torch.dtype, main_params_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a param of ``param_dtype`` is updated in: never narrower than the param itself."""
    if main_params_dtype is None:
        return param_dtype
    return torch.promote_types(param_dtype, main_params_dtype)


def has_master(param_dtype: torch.dtype, main_params_dtype: torch.dtype | None) -> bool:
    """True when a param of ``param_dtype`` is updated through a separate, wider master copy."""
    return master_dtype(param_dtype, main_params_dtype) != param_dtype


def adopt_written(master: torch.Tensor, written: torch.Tensor) -> None:
    """The master takes the param's value ``written`` wherever that differs from the master's cast.

    Same dtype: the param is the master. Lower precision: an element whose cast
    still equals the param keeps the master's extra precision (it was not written).
    Both tensors on one device (the caller copies the param to the master's side).
    """
    if written.dtype == master.dtype:
        master.copy_(written)
        return
    changed = written != master.to(written.dtype)
    master.copy_(torch.where(changed, written.to(master.dtype), master))


def canonical_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (one param's saved state) with a master saved under a legacy key moved to :data:`MASTER_KEY`.

    Returns ``state`` itself when there is nothing to rename; never changes it in place.
    ``ValueError`` when both keys are present (two masters: which one is the truth is unknown).
    """
    legacy = [k for k in LEGACY_MASTER_KEYS if k in state]
    if not legacy:
        return state
    if MASTER_KEY in state or len(legacy) > 1:
        raise ValueError(
            f"optimizer state holds a master weight under both {MASTER_KEY!r} and {legacy!r}; keep the one "
            f"that is the truth, under {MASTER_KEY!r}"
        )
    renamed = {k: v for k, v in state.items() if k != legacy[0]}
    renamed[MASTER_KEY] = state[legacy[0]]
    return renamed


def policy_with_fp32_update(precision: PrecisionPolicy | None, param_update_in_fp32: bool | None) -> PrecisionPolicy:
    """The policy ``HybridDeviceOptimizer`` runs with, given its deprecated ``param_update_in_fp32=``.

    ``None`` (not passed): ``precision`` (default ``PrecisionPolicy()``). ``True`` / ``False``
    warn (``DeprecationWarning``, naming the replacement) and mean
    ``main_params_dtype=torch.float32`` (the default) / ``main_params_dtype=None``;
    ``True`` with a policy that says "no master" is a contradiction (``ValueError``).
    """
    policy = precision if precision is not None else PrecisionPolicy()
    if param_update_in_fp32 is None:
        return policy
    replacement = "PrecisionPolicy()" if param_update_in_fp32 else "PrecisionPolicy(main_params_dtype=None)"
    warnings.warn(
        f"param_update_in_fp32={param_update_in_fp32} is deprecated: the master weight has one setting, "
        f"PrecisionPolicy.main_params_dtype; pass precision={replacement} instead",
        DeprecationWarning,
        stacklevel=3,
    )
    if param_update_in_fp32:
        if policy.main_params_dtype is None:
            raise ValueError(
                "param_update_in_fp32=True contradicts precision=PrecisionPolicy(main_params_dtype=None); "
                "drop param_update_in_fp32 and set main_params_dtype (torch.float32 for fp32 masters)"
            )
        return policy
    return replace(policy, main_params_dtype=None)
