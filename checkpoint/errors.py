"""The format's own read errors, one leaf module so that storage and manifest share them."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "LoadTargetError", "NotACheckpointError"]


class NotACheckpointError(ValueError):
    """A directory exists but holds no committed checkpoint (no manifest)."""


class CheckpointCorruptError(ValueError):
    """A checkpoint whose files do not match its manifest or cannot be read (truncated, corrupt, crafted)."""


class LoadTargetError(TypeError):
    """A value being loaded into cannot take the stored data (the caller's state dict is at fault, not the files)."""
