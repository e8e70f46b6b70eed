"""Host offload of optimizer state and updates for sharded data-parallel training.

This package is also the base layer: its leaf modules (``shard_spec``, ``grad``,
``precision``, ``fresh_state``) are what ``checkpoint`` and ``optim`` import.
``HybridDeviceOptimizer`` is imported on first use, so that importing a leaf
module (as ``import checkpoint`` does) does not load the optimizer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offload_fsdp.optimizer import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]


def __getattr__(name: str) -> Any:
    if name == "HybridDeviceOptimizer":
        return importlib.import_module("offload_fsdp.optimizer").HybridDeviceOptimizer
    raise AttributeError(f"module 'offload_fsdp' has no attribute {name!r}")
