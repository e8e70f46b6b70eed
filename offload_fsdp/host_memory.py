"""Exactly-sized host buffers, optionally page-locked, carved into aligned views.

Why not ``torch.empty(..., pin_memory=True)`` per buffer: torch's pinned-memory
caching allocator rounds every request up to a power of two, so a 5 GiB
optimizer state would reserve 8 GiB of page-locked RAM (memory the OS can no
longer page or give to other processes). Instead all host buffers of one kind
are laid out first, allocated as ONE ordinary (pageable) byte tensor of the
exact total size, and that range is page-locked in place with
``cudaHostRegister``. Reserved == used, up to 64-byte alignment padding.

That is a CUDA-only fast path. On any other accelerator (XPU, a PrivateUse1
backend), or where registration fails, the arena comes from torch's pinned
allocator (``pin_memory=True``: page-locked, rounded up); where nothing can
pin, it stays pageable and copies are synchronous in effect (logged).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["HostArena", "HostLayout"]

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64  # one cache line: keeps every view's start vector-aligned for the fused kernels


@dataclass
class HostLayout:
    """Layout: collects (numel, dtype) requests, then allocates them as one arena."""

    requests: list[tuple[int, torch.dtype, int]] = field(default_factory=list)
    """(numel, dtype, byte offset) of each request, in order"""
    nbytes: int = 0

    def add(self, numel: int, dtype: torch.dtype) -> int:
        """Reserve room for a flat buffer; returns its handle for :meth:`HostArena.view`."""
        offset = -(-self.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        self.requests.append((numel, dtype, offset))
        self.nbytes = offset + numel * dtype.itemsize
        return len(self.requests) - 1

    @property
    def used_bytes(self) -> int:
        return sum(n * d.itemsize for n, d, _ in self.requests)

    def allocate(self, *, pin: bool) -> HostArena:
        return HostArena(self, pin=pin)


def _register_pinned(storage: torch.Tensor) -> bool:
    """Page-lock ``storage`` in place; returns False (logged) when the runtime cannot."""
    if not torch.cuda.is_available() or storage.nbytes == 0:
        return False
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes, 0)
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister of %d bytes failed (error %s); using torch's pinned allocator", storage.nbytes, err
        )
        return False
    # Unregister exactly once, when the byte tensor itself is collected (views keep it alive).
    weakref.finalize(storage, cudart.cudaHostUnregister, storage.data_ptr())
    return True


def _allocate(numel: int, dtype: torch.dtype, *, pin: bool) -> tuple[torch.Tensor, bool]:
    """A zeroed host tensor and whether it is page-locked.

    CUDA fast path: an exact-size pageable allocation registered in place. Any
    accelerator (CUDA too, when registration fails): torch's pinned allocator,
    which rounds the request up to a power of two. Neither: pageable, logged.
    """
    if not pin or numel == 0:
        return torch.zeros(numel, dtype=dtype), False
    if torch.cuda.is_available():
        storage = torch.zeros(numel, dtype=dtype)
        if _register_pinned(storage):
            return storage, True
    try:
        return torch.zeros(numel, dtype=dtype, pin_memory=True), True
    except RuntimeError as exc:  # no accelerator, or its runtime cannot pin
        logger.warning(
            "page-locking %d host bytes failed (%s); host buffers stay pageable", numel * dtype.itemsize, exc
        )
        return torch.zeros(numel, dtype=dtype), False


class HostArena:
    """One exact-size host allocation; :meth:`view` returns the flat buffer of a request.

    Zero-initialised (also touches every page up front, so the first step does
    not pay page faults). ``pinned`` tells whether page-locking succeeded.
    """

    def __init__(self, layout: HostLayout, *, pin: bool) -> None:
        self.layout = layout
        dtypes = {dtype for _, dtype, _ in layout.requests}
        # One dtype (every pageable arena): a typed storage, so views are plain slices. Views
        # re-typed from bytes (``.view(dtype)``) break torch.save / deepcopy of DTensors over them.
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        self.storage, self.pinned = _allocate(-(-layout.nbytes // self.dtype.itemsize), self.dtype, pin=pin)

    @property
    def reserved_bytes(self) -> int:
        return self.storage.nbytes

    def view(self, handle: int) -> torch.Tensor:
        return self.view_in(self.storage, handle)

    def view_in(self, flat: torch.Tensor, handle: int) -> torch.Tensor:
        """The flat buffer of a request in ``flat``: this arena's storage, or a tensor like it (a device copy)."""
        numel, dtype, offset = self.layout.requests[handle]
        if dtype == self.dtype:  # offsets are 64-byte aligned, so a whole number of elements
            start = offset // dtype.itemsize
            return flat[start : start + numel]
        return flat[offset : offset + numel * dtype.itemsize].view(dtype)
