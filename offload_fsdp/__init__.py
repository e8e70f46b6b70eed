"""Host offload of optimizer state and updates for sharded data-parallel training."""

__all__: list[str] = []
