"""Adapters for the fused Adam of Transformer Engine and of NVIDIA apex.

Each adapter turns a :class:`~offload_fsdp.precision.PrecisionPolicy` and the
parameters' own dtypes into the constructor arguments the library understands,
imports the library lazily, and refuses (``ValueError``) what the library
cannot honour instead of quietly training in another precision.

Constructor facts relied on (checked against the libraries' sources):

* ``transformer_engine.pytorch.optimizers.FusedAdam(params, lr, betas, eps,
  weight_decay, amsgrad, *, bias_correction, adam_w_mode, capturable,
  master_weights, master_weight_dtype, exp_avg_dtype, exp_avg_sq_dtype,
  use_decoupled_grad, store_param_remainders)``; master weights fp32/fp16,
  moments fp32/fp16/bf16/uint8(fp8); ``capturable`` requires fp32 moments and
  fp32 master weights.
* ``apex.optimizers.FusedAdam(params, lr, bias_correction, betas, eps,
  adam_w_mode, weight_decay, amsgrad, set_grad_none, capturable,
  master_weights)``; moments are always fp32, gradients are read from
  ``.grad`` only, ``master_weights`` needs ``capturable=True`` and covers
  fp16/fp32 params only (bf16 params are updated in place without a master).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offload_fsdp.master import has_master
from offload_fsdp.precision import PrecisionPolicy

__all__ = ["FusedAdamPlan", "plan_fused_adam", "build_fused_adam", "fused_adam_class", "plan_for_main_params"]

logger = logging.getLogger(__name__)

TE_INSTALL_HINT = (
    "install NVIDIA Transformer Engine with PyTorch support, e.g. "
    "`pip install --no-build-isolation transformer_engine[pytorch]` (needs CUDA), "
    "or pick backend='torch'"
)
APEX_INSTALL_HINT = (
    "build NVIDIA apex from https://github.com/NVIDIA/apex with its CUDA extensions "
    "(`pip install -v --no-build-isolation --config-settings --build-option=--cuda_ext ./` in a clone); "
    "note that `pip install apex` installs an unrelated PyPI package; or pick backend='torch' / 'te'"
)


@dataclass(frozen=True, kw_only=True)
class FusedAdamPlan:
    """What a fused Adam must do for these params under this policy (backend independent)."""

    master_weights: bool
    """a separate main copy is needed: some param's dtype is narrower than ``main_params_dtype``"""
    master_weight_dtype: torch.dtype | None
    """dtype of that main copy (the policy's ``main_params_dtype``; None: the policy wants no master)"""
    use_decoupled_grad: bool
    """gradients live in ``param.decoupled_grad``: their dtype differs from some param's"""
    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    capturable: bool
    """CUDA graphs requested: the step must keep its tensors and scalars on the device"""
    param_dtypes: frozenset[torch.dtype]


def plan_fused_adam(params: list[torch.Tensor], policy: PrecisionPolicy, *, cuda_graphs: bool = False) -> FusedAdamPlan:
    """Derive the fused-Adam configuration from the params' dtypes and ``policy``."""
    param_dtypes = frozenset(p.dtype for p in params)
    grads_dtype = policy.resolved_main_grads_dtype
    return FusedAdamPlan(
        # FSDP2 keeps fp32 sharded params: those *are* the main params, a second
        # fp32 copy inside the optimizer would only waste 4 bytes per element.
        master_weights=any(has_master(d, policy.main_params_dtype) for d in param_dtypes),
        master_weight_dtype=policy.main_params_dtype,
        # No dtype set (no master, no main_grads_dtype): each grad in its param's own dtype, in .grad.
        use_decoupled_grad=grads_dtype is not None and any(d != grads_dtype for d in param_dtypes),
        exp_avg_dtype=policy.exp_avg_dtype,
        exp_avg_sq_dtype=policy.exp_avg_sq_dtype,
        capturable=cuda_graphs,
        param_dtypes=param_dtypes,
    )


def plan_for_main_params(policy: PrecisionPolicy) -> FusedAdamPlan:
    """The plan for an optimizer handed main params directly (``HybridDeviceOptimizer``'s device share).

    ``HybridDeviceOptimizer`` gives its ``gpu_optimizer_cls`` the fp32 masters
    (or the fp32 params themselves) with the gradient in ``.grad``: no master
    weights, no decoupled gradients; the moments still follow the policy.
    """
    return FusedAdamPlan(
        master_weights=False,
        master_weight_dtype=policy.main_params_dtype,
        use_decoupled_grad=False,
        exp_avg_dtype=policy.exp_avg_dtype,
        exp_avg_sq_dtype=policy.exp_avg_sq_dtype,
        capturable=False,
        # without masters the params keep their own dtypes, which the policy does not name
        param_dtypes=frozenset({policy.main_params_dtype} if policy.main_params_dtype is not None else ()),
    )


def _import_class(module_name: str, class_name: str, hint: str) -> type:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{module_name}.{class_name} is not importable ({exc}); {hint}") from exc
    try:
        return getattr(module, class_name)
    except AttributeError as exc:
        raise ImportError(f"{module_name} has no {class_name}; {hint}") from exc


def _import_apex_fused_adam() -> type:
    try:
        apex = importlib.import_module("apex")
    except ImportError as exc:
        raise ImportError(f"NVIDIA apex is not installed ({exc}); {APEX_INSTALL_HINT}") from exc
    try:
        module = importlib.import_module("apex.optimizers")
    except ModuleNotFoundError as exc:
        # `import apex` worked but there is no apex.optimizers: that is the PyPI
        # package of the same name, which has nothing to do with NVIDIA apex.
        location = getattr(apex, "__file__", None) or "an unknown location"
        raise ImportError(
            f"the `apex` package installed at {location} is not NVIDIA apex (it has no apex.optimizers; "
            f"it is probably the unrelated PyPI package `apex`): `pip uninstall apex`, then {APEX_INSTALL_HINT}"
        ) from exc
    if not hasattr(module, "FusedAdam"):
        raise ImportError(f"apex.optimizers has no FusedAdam; {APEX_INSTALL_HINT}")
    return module.FusedAdam


def _accepted(cls: Callable[..., Any], kwargs: dict[str, Any], required: set[str], hint: str) -> dict[str, Any]:
    """Check that ``cls`` takes every keyword in ``required``; drop unknown keywords left at their defaults.

    A keyword we need with a non-default value but the installed version lacks is
    an installation problem (too old), reported as ``ImportError`` with ``hint``.
    """
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # builtins / C extensions without a signature: trust the caller
        return kwargs
    names = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values()):
        return kwargs
    missing = sorted(k for k in required if k not in names)
    if missing:
        raise ImportError(
            f"the installed {cls.__module__}.{cls.__qualname__} does not accept {', '.join(missing)}, "
            f"which this precision policy needs; upgrade it: {hint}"
        )
    return {k: v for k, v in kwargs.items() if k in names}


def _te_class_and_kwargs(plan: FusedAdamPlan, adam_w_mode: bool) -> tuple[type, dict[str, Any]]:
    if plan.master_weights and plan.master_weight_dtype not in (torch.float32, torch.float16):
        raise ValueError(
            f"Transformer Engine FusedAdam keeps master weights in fp32 or fp16, not "
            f"{plan.master_weight_dtype}; use PrecisionPolicy(main_params_dtype=torch.float32)"
        )
    if plan.capturable and torch.bfloat16 in (plan.exp_avg_dtype, plan.exp_avg_sq_dtype):
        raise ValueError(
            "Transformer Engine FusedAdam is capturable (cuda_graphs=True) only with fp32 Adam state; "
            "use exp_avg_dtype=exp_avg_sq_dtype=torch.float32 or cuda_graphs=False"
        )
    cls = _import_class("transformer_engine.pytorch.optimizers", "FusedAdam", TE_INSTALL_HINT)
    kwargs: dict[str, Any] = dict(
        adam_w_mode=adam_w_mode,
        master_weights=plan.master_weights,
        exp_avg_dtype=plan.exp_avg_dtype,
        exp_avg_sq_dtype=plan.exp_avg_sq_dtype,
        use_decoupled_grad=plan.use_decoupled_grad,
        capturable=plan.capturable,
    )
    if plan.master_weights:
        kwargs["master_weight_dtype"] = plan.master_weight_dtype
    required = {"adam_w_mode"} | {
        k for k, v in kwargs.items() if k != "adam_w_mode" and v not in (False, torch.float32)
    }
    return cls, _accepted(cls, kwargs, required, TE_INSTALL_HINT)


def _apex_class_and_kwargs(plan: FusedAdamPlan, adam_w_mode: bool) -> tuple[type, dict[str, Any]]:
    if plan.use_decoupled_grad:
        raise ValueError(
            "apex FusedAdam reads gradients from .grad only, but this policy keeps gradients of another dtype "
            "than the params in .decoupled_grad; use backend='te' (use_decoupled_grad=True) or "
            "PrecisionPolicy(main_grads_dtype=<the param dtype>)"
        )
    if torch.bfloat16 in (plan.exp_avg_dtype, plan.exp_avg_sq_dtype):
        raise ValueError(
            "apex FusedAdam keeps Adam state in fp32 only; for bf16 exp_avg / exp_avg_sq use backend='te' "
            "or offload_fraction=... (HybridDeviceOptimizer)"
        )
    if plan.master_weights and torch.bfloat16 in plan.param_dtypes:
        raise ValueError(
            "apex FusedAdam keeps no fp32 master copy of bf16 params (its master_weights covers fp16 only), "
            "so bf16 params would be updated in bf16; use backend='te' or fp32 params"
        )
    capturable = plan.capturable
    if plan.master_weights and not capturable:
        # apex implements master weights only in its capturable kernel.
        logger.info("apex FusedAdam: master_weights=True needs capturable=True; enabling it")
        capturable = True
    cls = _import_apex_fused_adam()
    kwargs: dict[str, Any] = dict(adam_w_mode=adam_w_mode, capturable=capturable, master_weights=plan.master_weights)
    required = {"adam_w_mode"} | {k for k, v in kwargs.items() if k != "adam_w_mode" and v}
    return cls, _accepted(cls, kwargs, required, APEX_INSTALL_HINT)


_RESOLVERS = {"te": _te_class_and_kwargs, "apex": _apex_class_and_kwargs}


def build_fused_adam(
    backend: str, params: list[Any], plan: FusedAdamPlan, *, adam_w_mode: bool, **hp: Any
) -> torch.optim.Optimizer:
    """The ``backend`` ("te" or "apex") ``FusedAdam`` over ``params`` (tensors or param-group dicts), per ``plan``.

    Raises ``ValueError`` for what the library cannot honour, ``ImportError``
    (with an install hint) when it is missing or too old.
    """
    cls, kwargs = _RESOLVERS[backend](plan, adam_w_mode)
    logger.info("building %s.%s with %s", cls.__module__, cls.__qualname__, kwargs)
    return cls(params, **hp, **kwargs)


def fused_adam_class(backend: str, plan: FusedAdamPlan, *, adam_w_mode: bool) -> type[torch.optim.Optimizer]:
    """A subclass of the ``backend`` ``FusedAdam`` whose constructor adds ``plan``'s arguments.

    For callers that take an optimizer *class* (``HybridDeviceOptimizer``'s
    ``gpu_optimizer_cls``) and build it over param groups themselves.
    """
    cls, kwargs = _RESOLVERS[backend](plan, adam_w_mode)

    def __init__(self: torch.optim.Optimizer, params: Any, **hp: Any) -> None:
        # the base is resolved at run time, so a class statement with super() cannot name it
        cls.__init__(self, params, **{**hp, **kwargs})  # type: ignore[misc]

    return type(
        f"Planned{cls.__name__}",
        (cls,),
        {"__init__": __init__, "__module__": __name__, "__doc__": f"{cls.__qualname__} with {kwargs}"},
    )
