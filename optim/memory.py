"""Bytes per parameter held by the optimizer side of training, on the host and on the device.

One function, :func:`bytes_per_param`, is the single source of truth for the
memory table in ``docs/optim.md``; ``python -m optim.memory`` prints that table
(in Markdown) so the document is regenerated, never edited by hand.

What is counted, per parameter element of the local shard:

* device, always: the model parameter (``param_dtype``) and its gradient, which
  is accumulated in the policy's resolved ``main_grads_dtype`` (in
  ``decoupled_grad`` when that differs from the parameter's dtype, so there is
  no second gradient in the param dtype);
* the main (master) parameter, only when its dtype differs from the model
  parameter's: an fp32 model parameter *is* the main parameter (FSDP2 keeps
  fp32 sharded params; fused Adam is built with ``master_weights=False``);
* the optimizer state, as the class's host kernel lays it out
  (:mod:`offload_fsdp.host_kernels`): Adam's ``exp_avg`` and ``exp_avg_sq`` in their
  policy dtypes, SGD's ``momentum_buffer`` in the main param's dtype (``momentum=0``
  keeps none: ``name="sgd_no_momentum"``), Adagrad's ``sum`` in the main param's dtype.

With offload (``HybridDeviceOptimizer``), the share ``offload`` of elements
keeps main param and Adam state on the host instead, where the main param always
exists (the host step needs its own copy of the truth), plus the pinned staging
buffers the copies go through: the gradient in its own dtype (device to host)
and, when the model param is not in the main dtype, the param-dtype cast of the
update (host to device; with equal dtypes the main param is copied directly).

Not counted: activations, communication buffers (FSDP2's ``reduce_dtype``), the
per-tensor ``step`` scalar, allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from offload_fsdp.defaults import class_defaults
from offload_fsdp.host_kernels import host_kernel_for
from offload_fsdp.master import master_dtype
from offload_fsdp.precision import PrecisionPolicy

__all__ = ["MemoryFootprint", "bytes_per_param", "memory_table", "STANDARD_CONFIGS"]


@dataclass(frozen=True, kw_only=True)
class MemoryFootprint:
    """Bytes per parameter element on the host and on the device, with the parts that make them up."""

    host: float
    """bytes per element kept in host memory"""
    device: float
    """bytes per element kept in device memory"""
    host_parts: dict[str, float] = field(default_factory=dict)
    """name -> bytes for each host buffer (``main_param``, ``exp_avg``, ``grad_staging``, ...)"""
    device_parts: dict[str, float] = field(default_factory=dict)
    """name -> bytes for each device buffer (``param``, ``grad``, ...)"""


_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {}),
    "adam": (torch.optim.Adam, {}),
    "sgd": (torch.optim.SGD, {"momentum": 0.9}),
    "sgd_no_momentum": (torch.optim.SGD, {}),
    "adagrad": (torch.optim.Adagrad, {}),
}
"""name -> (class, the settings that decide its state) for each name :func:`bytes_per_param` takes"""


def _state_dtypes(name: str, policy: PrecisionPolicy, main_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Optimizer ``name``'s per-element state buffers and their dtypes under ``policy`` (``main_dtype``: what it
    steps), as its host kernel lays them out (:meth:`offload_fsdp.host_kernels.HostKernel.state_layout`)."""
    if name not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer name {name!r}; valid names: {', '.join(_OPTIMIZERS)}")
    cls, settings = _OPTIMIZERS[name]
    kernel = host_kernel_for(cls)
    assert kernel is not None, f"{cls.__name__} has a host kernel"
    return kernel.state_layout({**class_defaults(cls), **settings}, main_dtype, policy)


def bytes_per_param(
    policy: PrecisionPolicy | None,
    param_dtype: torch.dtype,
    offload: float = 0.0,
    *,
    name: str = "adamw",
) -> MemoryFootprint:
    """Host and device bytes per parameter element for ``policy`` and model params of ``param_dtype``.

    ``offload`` is the share of elements whose optimizer work runs on the host
    (``HybridDeviceOptimizer(offload_fraction=...)``); 0 means no offload. The
    result is exact for 0 and 1 and the element-weighted mix in between.
    ``name``: the optimizer, as ``build_optimizer`` names it (``"adamw"``, ``"adam"``,
    ``"sgd"`` with momentum), ``"sgd_no_momentum"`` (no state) or ``"adagrad"``.
    """
    if not 0.0 <= offload <= 1.0:
        raise ValueError(f"offload={offload} must lie in [0, 1] (a share of the parameter elements)")
    policy = policy if policy is not None else PrecisionPolicy()
    grad_dtype = policy.resolved_main_grads_dtype or param_dtype  # None: no master, grads in the param's dtype
    main_dtype = master_dtype(param_dtype, policy.main_params_dtype)
    state_dtypes = _state_dtypes(name, policy, main_dtype)
    separate_main = main_dtype != param_dtype

    device_parts: dict[str, float] = {"param": param_dtype.itemsize, "grad": grad_dtype.itemsize}
    host_parts: dict[str, float] = {}
    on_device = 1.0 - offload
    optimizer_parts = {"main_param": main_dtype.itemsize}
    optimizer_parts.update({state: dtype.itemsize for state, dtype in state_dtypes.items()})
    for part, size in optimizer_parts.items():
        if part == "main_param" and not separate_main:
            # On the device the fp32 model param is the main param; the host needs its own copy.
            if offload:
                host_parts[part] = offload * size
            continue
        if on_device:
            device_parts[part] = on_device * size
        if offload:
            host_parts[part] = offload * size
    if offload:
        host_parts["grad_staging"] = offload * policy.grad_staging_dtype(param_dtype).itemsize
        if separate_main:
            host_parts["param_staging"] = offload * param_dtype.itemsize
    return MemoryFootprint(
        host=sum(host_parts.values()),
        device=sum(device_parts.values()),
        host_parts=host_parts,
        device_parts=device_parts,
    )


_BF16, _FP32 = torch.bfloat16, torch.float32

STANDARD_CONFIGS: list[tuple[str, torch.dtype, PrecisionPolicy]] = [
    ("fp32 params, fp32 grads, fp32 Adam state", _FP32, PrecisionPolicy()),
    (
        "fp32 params, fp32 grads, bf16 Adam state",
        _FP32,
        PrecisionPolicy(exp_avg_dtype=_BF16, exp_avg_sq_dtype=_BF16),
    ),
    # main_grads_dtype set explicitly: the host stages grads in it (else in the param's dtype)
    ("bf16 params + fp32 master, fp32 decoupled grads, fp32 state", _BF16, PrecisionPolicy(main_grads_dtype=_FP32)),
    (
        "bf16 params + fp32 master, fp32 decoupled grads, bf16 state",
        _BF16,
        PrecisionPolicy(main_grads_dtype=_FP32, exp_avg_dtype=_BF16, exp_avg_sq_dtype=_BF16),
    ),
    ("bf16 params + fp32 master, bf16 grads, fp32 state", _BF16, PrecisionPolicy(main_grads_dtype=_BF16)),
    (
        "bf16 params + fp32 master, bf16 grads, bf16 state",
        _BF16,
        PrecisionPolicy(main_grads_dtype=_BF16, exp_avg_dtype=_BF16, exp_avg_sq_dtype=_BF16),
    ),
]
"""(label, model param dtype, policy) for each row of the table in docs/optim.md"""


def _fmt(value: float) -> str:
    return f"{value:g}"


def _parts(parts: dict[str, float]) -> str:
    return " + ".join(f"{_fmt(v)} {k}" for k, v in parts.items()) or "-"


def memory_table(configs: list[tuple[str, torch.dtype, PrecisionPolicy]] | None = None) -> str:
    """The Markdown table of host / device bytes per parameter, without and with full offload."""
    rows = [
        "| configuration | no offload: device | no offload: host | offload=1: device | offload=1: host "
        "| offload=1: host breakdown |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, param_dtype, policy in configs if configs is not None else STANDARD_CONFIGS:
        plain = bytes_per_param(policy, param_dtype, 0.0)
        full = bytes_per_param(policy, param_dtype, 1.0)
        rows.append(
            f"| {label} | {_fmt(plain.device)} | {_fmt(plain.host)} | {_fmt(full.device)} | {_fmt(full.host)} "
            f"| {_parts(full.host_parts)} |"
        )
    return "\n".join(rows)


def _main() -> None:
    import sys

    sys.stdout.write(memory_table() + "\n")


if __name__ == "__main__":
    _main()
