"""``build_optimizer``: one call that configures an optimizer right for a precision policy.

The caller names the algorithm and the backend; this module derives the
backend's arguments from the policy and the parameters' dtypes (master weights,
decoupled gradients, moment dtypes, CUDA-graph capture) and never substitutes
another optimizer when the requested one is unavailable.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch

# the device list torch.optim consults for fused=True (no public name); renamed -> import fails
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.grad import local_tensor
from offload_fsdp.graph_safe import keep_grad_buffers
from offload_fsdp.precision import PrecisionPolicy
from optim.fused_adapters import (
    build_fused_adam,
    fused_adam_class,
    plan_for_main_params,
    plan_fused_adam,
)
from optim.main_params import enable_main_params

__all__ = ["BACKENDS", "build_optimizer"]

logger = logging.getLogger(__name__)

BACKENDS: dict[str, tuple[str, ...]] = {
    "torch": ("adamw", "adam", "sgd"),
    "te": ("adamw", "adam"),
    "apex": ("adamw", "adam"),
}
"""backend -> the optimizer names it builds"""

_TORCH_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


def _tensors_of(params: list[Any]) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            if "params" not in item:
                raise ValueError(f"a param group dict needs a 'params' entry, got keys {sorted(item)}")
            group = item["params"]
            tensors.extend([group] if torch.is_tensor(group) else list(group))
        elif isinstance(item, tuple) and len(item) == 2 and torch.is_tensor(item[1]):
            tensors.append(item[1])  # (name, param) pairs, as torch.optim accepts them
        elif torch.is_tensor(item):
            tensors.append(item)
        else:
            raise TypeError(f"params must be tensors or param-group dicts, got {type(item).__name__}")
    return tensors


def _fused_fits(tensors: list[torch.Tensor]) -> bool:
    """torch's fused Adam/AdamW/SGD kernel supports every one of these params (device and dtype)."""
    devices = _get_fused_kernels_supported_devices()
    return all(
        local_tensor(t).device.type in devices and torch.is_floating_point(t) and not t.is_sparse for t in tensors
    )


def _build_torch(
    params: list[Any],
    tensors: list[torch.Tensor],
    name: str,
    policy: PrecisionPolicy,
    cuda_graphs: bool,
    hp: dict[str, Any],
) -> torch.optim.Optimizer:
    plan = plan_fused_adam(tensors, policy, cuda_graphs=cuda_graphs)
    needs_main = plan.master_weights or plan.use_decoupled_grad
    low_state = torch.bfloat16 in (policy.exp_avg_dtype, policy.exp_avg_sq_dtype)
    if low_state and name != "sgd":
        raise ValueError(
            "backend='torch' keeps Adam state in the dtype of the params it steps; for bf16 "
            "exp_avg / exp_avg_sq use backend='te' or offload_fraction=... (HybridDeviceOptimizer)"
        )
    if low_state:
        warnings.warn("PrecisionPolicy exp_avg_dtype / exp_avg_sq_dtype do not apply to SGD; ignored", stacklevel=3)
    if cuda_graphs and needs_main:
        raise ValueError(
            "backend='torch' steps main params / decoupled grads through Python hooks, which a CUDA graph "
            "cannot capture; use backend='te' for cuda_graphs=True with these params"
        )
    kwargs = dict(hp)
    if "fused" not in kwargs and "foreach" not in kwargs:
        # Fused when every param's device has the kernel (CUDA; CPU too in torch 2.13), else foreach.
        if _fused_fits(tensors):
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
    if cuda_graphs:
        if name == "sgd":
            raise ValueError("torch.optim.SGD has no capturable mode; use name='adamw' or 'adam' for cuda_graphs")
        kwargs["capturable"] = True
    optimizer = _TORCH_CLASSES[name](params, **kwargs)
    if not cuda_graphs:
        # Always on (a cheap loop per step): a gradient may sit in decoupled_grad at run
        # time even when the policy's dtypes all match (e.g. written by Megatron-FSDP / TE).
        enable_main_params(optimizer, policy.main_params_dtype)
    logger.info("built torch.optim.%s with %s", type(optimizer).__name__, kwargs)
    return optimizer


_SHARED_ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def _build_offloaded(
    params: list[Any],
    tensors: list[torch.Tensor],
    name: str,
    backend: str,
    policy: PrecisionPolicy | None,
    offload_fraction: float,
    cuda_graphs: bool,
    graph_safe_grads: bool,
    hp: dict[str, Any],
) -> torch.optim.Optimizer:
    if cuda_graphs:
        raise ValueError("cuda_graphs=True cannot capture a host optimizer step; leave offload_fraction=None")
    # Exactly torch's class: HybridDeviceOptimizer's host kernels are registered for torch.optim.Adam /
    # AdamW / SGD themselves (a subclass would fall back to one instance per bucket).
    cpu_cls = _TORCH_CLASSES[name]
    gpu_cls: type[torch.optim.Optimizer] = cpu_cls
    kwargs = dict(hp)
    if backend in ("te", "apex"):
        plan = plan_for_main_params(policy or PrecisionPolicy())
        gpu_cls = fused_adam_class(backend, plan, adam_w_mode=(name == "adamw"))
        # Both shares must run the same Adam: HybridDeviceOptimizer gives a device class its own
        # default for a hyper-parameter left at the host class's (TE/apex weight_decay=0 vs AdamW's
        # 0.01), so the torch defaults of what the user left out are passed explicitly.
        signature = inspect.signature(cpu_cls).parameters
        for key in _SHARED_ADAM_HYPERPARAMETERS:
            kwargs.setdefault(key, signature[key].default)
    elif "fused" not in kwargs and "foreach" not in kwargs and _fused_fits(tensors):
        kwargs["fused"] = True  # the device share's torch optimizer; the host share is fused regardless
    return HybridDeviceOptimizer(
        params,
        offload_fraction=offload_fraction,
        cpu_optimizer_cls=cpu_cls,
        gpu_optimizer_cls=gpu_cls,
        precision=policy,
        graph_safe_grads=graph_safe_grads,
        **kwargs,
    )


def build_optimizer(
    params: Iterable[Any],
    name: str = "adamw",
    *,
    backend: str = "torch",
    precision: PrecisionPolicy | None = None,
    offload_fraction: float | None = None,
    cuda_graphs: bool = False,
    graph_safe_grads: bool = False,
    **hyperparameters: Any,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` on ``backend`` configured for ``precision`` (default: fp32 main params and state).

    * ``backend="torch"``: ``torch.optim.AdamW`` / ``Adam`` / ``SGD``, fused where
      every param's device has the fused kernel, else foreach. Gradients are read
      with ``get_grad`` and params not in the main dtype are stepped through
      main copies, by optimizer hooks (:func:`optim.main_params.enable_main_params`;
      not registered with ``cuda_graphs=True``, where such params are refused).
    * ``backend="te"``: Transformer Engine ``FusedAdam`` with ``master_weights``
      only when the params are not already the main params,
      ``use_decoupled_grad`` when the gradient dtype differs from the params',
      moment dtypes from the policy.
    * ``backend="apex"``: NVIDIA apex ``FusedAdam`` (fp32 moments, ``.grad`` only).
    * ``offload_fraction``: an ``offload_fsdp.HybridDeviceOptimizer`` whose host
      step is its host kernel (:mod:`offload_fsdp.host_kernels`): Adam(W) honouring
      ``precision`` (bf16 host moments included), or SGD as ``SGD(fused=True)``
      (momentum buffer in the master's dtype); its device share is stepped by the
      torch class or by the te / apex ``FusedAdam`` over the fp32 masters.
    * ``cuda_graphs=True``: a capturable optimizer (device-side step and lr).
    * ``graph_safe_grads=True``: every trainable param's gradient is a view of a
      persistent buffer (``decoupled_grad`` when ``precision.main_grads_dtype`` differs
      from the param's dtype) and the optimizer's ``zero_grad`` zeroes it in place
      whatever ``set_to_none`` says (:mod:`offload_fsdp.graph_safe`), so a captured
      CUDA graph keeps writing the gradients the step reads. Plain tensors only.

    Raises ``ValueError`` for an unknown name / backend or a combination the
    backend cannot honour, ``ImportError`` (with an install hint) when the
    backend's library is missing. ``hyperparameters`` (lr, betas, eps,
    weight_decay, ...) go to the optimizer unchanged.
    """
    backend_key = backend.lower() if isinstance(backend, str) else backend
    if backend_key not in BACKENDS:
        raise ValueError(f"unknown optimizer backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    name_key = name.lower() if isinstance(name, str) else name
    if name_key not in BACKENDS[backend_key]:
        raise ValueError(
            f"unknown optimizer name {name!r} for backend {backend_key!r}; valid names: "
            f"{', '.join(BACKENDS[backend_key])}"
        )
    params = list(params)
    tensors = _tensors_of(params)
    if not tensors:
        raise ValueError("build_optimizer got no parameters; pass model.parameters() or param groups")
    if offload_fraction is not None:
        # HybridDeviceOptimizer validates offload_fraction itself (a ValueError naming it).
        return _build_offloaded(
            params,
            tensors,
            name_key,
            backend_key,
            precision,
            offload_fraction,
            cuda_graphs,
            graph_safe_grads,
            hyperparameters,
        )
    policy = precision if precision is not None else PrecisionPolicy()
    if backend_key == "torch":
        optimizer = _build_torch(params, tensors, name_key, policy, cuda_graphs, hyperparameters)
    else:
        plan = plan_fused_adam(tensors, policy, cuda_graphs=cuda_graphs)
        optimizer = build_fused_adam(backend_key, params, plan, adam_w_mode=(name_key == "adamw"), **hyperparameters)
    if graph_safe_grads:
        keep_grad_buffers(optimizer, grad_dtype=policy.main_grads_dtype)
    return optimizer
