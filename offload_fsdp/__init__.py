"""Host offload of optimizer state and updates for sharded data-parallel training."""

from offload_fsdp.optimizer import HybridDeviceOptimizer

__all__ = ["HybridDeviceOptimizer"]
