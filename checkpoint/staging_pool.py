"""Host staging buffers kept from one async save to the next.

An async save copies (part of) the state into private host buffers so the
caller can go on changing its tensors. Allocating those buffers afresh for
every save is not free: pinned memory (``cudaHostAlloc`` on CUDA) of several GiB
costs hundreds of milliseconds to seconds, and even fresh pageable memory
pays a page fault per 4 KiB page on first touch, inside the caller's
blocking time. :class:`StagingPool` hands the buffers of the previous save
to the next one instead.

A buffer is keyed by what it holds: the state key (DCP's flattened key, the
same for the whole-snapshot and the bounded staging paths), shape, dtype and
whether it is pinned. Lifetime, one save after the other:

1. :meth:`StagingPool.begin_save`: the buffers the previous save used become
   free for this one. **Precondition:** the previous save is finished (its
   writer reads none of them any more). :mod:`checkpoint.async_save` keeps
   at most one save in flight and waits for it before staging the next, so a
   buffer is never handed to two saves in flight.
2. :meth:`StagingPool.buffer`, once per key while staging: a free buffer
   with the same key, else a fresh one; lent to this save either way.
3. :meth:`StagingPool.end_staging`: free buffers this save did not take (the
   model or its sharding changed, or the bounded path copied other tensors
   this time) are dropped, so the pool never holds more than what the last
   save used.

Not thread-safe by itself: the caller serialises every call (async saves
hold one lock while staging).
"""

from __future__ import annotations

import torch

__all__ = ["StagingPool"]

_BufferKey = tuple[str, tuple[int, ...], torch.dtype, bool]


class StagingPool:
    """Staging buffers of the last async save, lent again to the next one; see the module docstring."""

    def __init__(self) -> None:
        self._free: dict[_BufferKey, torch.Tensor] = {}
        self._lent: dict[_BufferKey, torch.Tensor] = {}
        self._reuse = True

    def begin_save(self, *, reuse: bool = True) -> None:
        """A save starts staging. Precondition: the previous save is finished.

        With ``reuse=False`` the save gets fresh buffers and keeps none, and
        what the pool held is dropped (the last save used none of it).
        """
        # Whatever is still free here was not taken by the previous save: end_staging dropped it.
        self._free = self._lent if reuse else {}
        self._lent = {}
        self._reuse = reuse

    def buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous host tensor of ``like``'s shape and dtype, for the state under ``key``.

        Pinned when ``like`` lives on an accelerator (so the D2H copy into it
        is asynchronous; ``pin_memory`` pins for the current accelerator).
        Its contents are whatever the last save staged.
        """
        pinned = like.device.type != "cpu" and torch.accelerator.is_available()
        slot = (key, tuple(like.shape), like.dtype, pinned)
        held = self._free.pop(slot, None)
        if held is None:
            held = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
        if self._reuse:
            self._lent[slot] = held
        return held

    def end_staging(self) -> None:
        """The save took every buffer it needs: drop the free ones it did not take."""
        self._free = {}

    def clear(self) -> None:
        """Forget every buffer. One lent to a save in flight lives on until that save lets go of it."""
        self._free = {}
        self._lent = {}

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory the pool keeps for the next save (lent to the last one, or free)."""
        return sum(t.numel() * t.element_size() for t in (*self._free.values(), *self._lent.values()))
