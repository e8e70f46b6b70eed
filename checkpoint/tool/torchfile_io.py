"""One ``torch.save`` file: streaming export and a reader for import.

``torch.save`` wants every tensor in memory at once. Export instead writes the
file's skeleton first (``torch.serialization.skip_data`` with fake tensors:
the zip records are laid out, the storage bytes left empty), maps it back with
``torch.load(mmap=True)`` over a shared mapping, and fills one tensor at a time
in place. After each tensor its pages are handed back to the kernel
(``madvise(MADV_DONTNEED)``: the data stays in the page cache and reaches the
file), so resident memory stays near one tensor. The result is an ordinary
file that ``torch.load(weights_only=True)`` reads.

Import reads with ``torch.load(mmap=True, weights_only=True)``, so it, too,
touches one tensor at a time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# skip_data's documented way to lay out storages without allocating them (meta tensors would
# be saved as meta tensors); FakeTensorMode has no public import path yet
from torch._subclasses.fake_tensor import FakeTensorMode

from checkpoint.durable import disk_full_is_clear
from checkpoint.tool.stream import Entry

__all__ = ["TorchFileSource", "fill_tensors", "reserve_space", "write_skeleton"]

logger = logging.getLogger(__name__)

_FULL_PREFIXES = ("model.", "optimizer.", "extra.")


def write_skeleton(tmp: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], objects: dict[str, Any]) -> None:
    """The file's zip records, storages left empty (``torch.serialization.skip_data``)."""
    skeleton: dict[str, Any] = {}
    with FakeTensorMode():
        for name, dtype, shape in specs:
            skeleton[name] = torch.empty(shape, dtype=dtype)
    skeleton.update(objects)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, tmp)
    # skip_data left out the bytes of tensors inside object values too (a tuple (rng_state, seed)): fill them
    held = {name: _tensors_in(value) for name, value in objects.items()}
    if any(held.values()):
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            mapped = torch.load(tmp, mmap=True, weights_only=True)
        for name, tensors in held.items():
            for dst, src in zip(_tensors_in(mapped[name]), tensors):
                dst.copy_(src)
        del mapped


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors inside a value of lists, tuples and dicts, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def reserve_space(tmp: Path) -> None:
    """Allocate every block of the skeleton ``tmp`` now, so filling it through the mapping cannot run out of space.

    The skeleton's storages are holes; a store into a hole the file system
    cannot back kills the process with SIGBUS instead of raising. Raises
    :class:`~checkpoint.durable.DiskFullError` (and removes ``tmp``) when the
    space is not there.
    """
    try:
        with disk_full_is_clear(tmp):
            fd = os.open(tmp, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    _write_zeros_over_holes(fd, size)  # no fallocate here: allocate by writing
            finally:
                os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_zeros_over_holes(fd: int, size: int) -> None:
    """Allocate a file's blocks the portable way: read each piece and write it back (holes read as zeros)."""
    piece = 16 << 20
    for start in range(0, size, piece):
        data = os.pread(fd, min(piece, size - start), start)
        os.pwrite(fd, data, start)


def fill_tensors(
    tmp: Path,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    values: Iterator[tuple[str, torch.Tensor]],
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Fill the tensors named in ``specs`` (a subset is fine: processes can share a file) from ``values``."""
    # MAP_SHARED: writes into the loaded tensors go to the file, not to private copies
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        mapped = torch.load(tmp, mmap=True, weights_only=True)
    for name, dtype, shape in specs:
        got_name, tensor = next(values)
        dst = mapped[name]
        if got_name != name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{got_name!r} arrived where {name!r} was planned (internal error; report it)")
        _fill_in_slabs(dst, tensor)
        if on_bytes is not None:
            on_bytes(Entry(name, "tensor", dtype, shape).nbytes)
        del dst, tensor
    del mapped


_SLAB_BYTES = 16 << 20


def _fill_in_slabs(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` a slab at a time, releasing each slab's pages once written.

    Copying the whole tensor first would make all of ``dst``'s mapped pages
    resident at once: a second copy of the largest tensor in RSS.
    """
    flat_dst, flat_src = dst.view(-1), src.contiguous().view(-1)
    step = max(_SLAB_BYTES // max(dst.element_size(), 1), 1)
    for start in range(0, flat_dst.numel(), step):
        piece = flat_dst[start : start + step]
        piece.copy_(flat_src[start : start + step])
        _release_pages(piece)


def _release_pages(t: torch.Tensor) -> None:
    """Drop ``t``'s pages from this process's resident set (Linux); they stay dirty in the page cache."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or not hasattr(os, "sysconf"):
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + nbytes - start
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madv_dontneed = 4
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), madv_dontneed)
    except (OSError, AttributeError):  # not Linux: memory is merely higher, the file is the same
        pass


class TorchFileSource:
    """The values of one ``torch.save`` file of a state dict, read through a memory map.

    Key naming: a dict whose keys already look like checkpoint keys
    (``model.*`` plus ``optimizer.*`` / ``extra.*``) is taken as is; a dict
    nested by component (``{"model": {...}, "optimizer": {...}}``) is
    flattened with dots; any other dict is a model state dict and gets
    ``prefix``. ``prefix=""`` forces names to be taken as is.
    """

    def __init__(self, path: str | Path, *, prefix: str | None = None) -> None:
        path = Path(path)
        try:
            data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise ValueError(
                f"{str(path)!r} is not a torch file that loads with weights_only=True "
                f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); pass a state-dict file"
            ) from exc
        if not isinstance(data, dict):
            raise ValueError(f"{str(path)!r} holds a {type(data).__name__}, not a state dict; pass a dict of tensors")
        flat = _flatten(data)
        if prefix is None:
            full = all(k.startswith(_FULL_PREFIXES) for k in flat) and any(not k.startswith("model.") for k in flat)
            nested = isinstance(data.get("model"), dict)
            prefix = "" if full or nested else "model."
        self._values = {prefix + k: v for k, v in flat.items()}
        self.entries: dict[str, Entry] = {}
        for key, value in sorted(self._values.items()):
            if isinstance(value, torch.Tensor):
                self.entries[key] = Entry(key, "tensor", value.dtype, tuple(value.shape))
            else:
                self.entries[key] = Entry(key, "object")

    def read(self, key: str) -> Any:
        value = self._values[key]
        return value


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out
