"""The ``fsdp_dtensor`` checkpoint format on top of torch.distributed.checkpoint."""

from checkpoint.manifest import FORMAT_VERSION, Manifest, NotACheckpointError, read_manifest

__all__ = ["FORMAT_VERSION", "Manifest", "NotACheckpointError", "read_manifest"]
