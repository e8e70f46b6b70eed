"""The format's own read errors, one leaf module so that storage and manifest share them."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "LoadTargetError", "NotACheckpointError", "some_of"]


class NotACheckpointError(ValueError):
    """A directory exists but holds no committed checkpoint (no manifest)."""


class CheckpointCorruptError(ValueError):
    """A checkpoint whose files do not match its manifest or cannot be read (truncated, corrupt, crafted)."""


class LoadTargetError(TypeError):
    """A value being loaded into cannot take the stored data (the caller's state dict is at fault, not the files)."""


def some_of(names: list[str], limit: int = 5) -> str:
    """``names`` for an error message: the first ``limit``, then how many there are in all."""
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
