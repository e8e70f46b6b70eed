"""Host offload of optimizer state and updates for sharded data-parallel training.

This package is also the base layer: its leaf modules (``shard_spec``, ``grad``,
``precision``, ``fresh_state``) are what ``checkpoint`` and ``optim`` import.
``HybridDeviceOptimizer`` and the host-kernel extension point (``HostKernel``,
``register_host_kernel``: :mod:`offload_fsdp.host_kernels`) are imported on first
use, so that importing a leaf module (as ``import checkpoint`` does) does not load
the optimizer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offload_fsdp.host_kernels import HostKernel, register_host_kernel
    from offload_fsdp.optimizer import HybridDeviceOptimizer
    from offload_fsdp.options import HostStepChoice, OffloadOptions, Schedule

__all__ = [
    "HostKernel",
    "HostStepChoice",
    "HybridDeviceOptimizer",
    "OffloadOptions",
    "Schedule",
    "register_host_kernel",
]

# name -> the module defining it, imported on first use (the extension points: offload_fsdp.host_kernels)
_LAZY = {
    "HybridDeviceOptimizer": "offload_fsdp.optimizer",
    "HostKernel": "offload_fsdp.host_kernels",
    "register_host_kernel": "offload_fsdp.host_kernels",
    "OffloadOptions": "offload_fsdp.options",
    "Schedule": "offload_fsdp.options",
    "HostStepChoice": "offload_fsdp.options",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'offload_fsdp' has no attribute {name!r}")
