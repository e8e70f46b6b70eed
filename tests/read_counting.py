"""A :class:`~checkpoint.storage_backend.Storage` counting the bytes read from each file (tests and benchmarks)."""

from __future__ import annotations

import os

from checkpoint.storage_backend import LocalStorage

__all__ = ["ReadCountingStorage"]


class _CountedFile:
    """A file opened for reading that adds every byte read to its storage's count for the file."""

    def __init__(self, raw, storage: ReadCountingStorage, name: str) -> None:
        self.raw, self.storage, self.name = raw, storage, name

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.storage.count(self.name, len(data))
        return data

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer) or 0
        self.storage.count(self.name, n)
        return n

    def __getattr__(self, name: str):
        return getattr(self.raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw.close()


class ReadCountingStorage(LocalStorage):
    """The local file system, counting the bytes read from each file (by name) and the read calls that
    read them; ``fail``: names that refuse to open, as a damaged or unreachable file would."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.counts: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.fail = fail

    def count(self, name: str, nbytes: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + nbytes
        self.calls[name] = self.calls.get(name, 0) + 1

    def open_read(self, path, *, follow_symlinks: bool = False):
        name = os.path.basename(path)
        if name.endswith(self.fail) and self.fail:
            raise OSError(f"{path}: unreachable (injected by the test)")
        return _CountedFile(super().open_read(path, follow_symlinks=follow_symlinks), self, name)

    def read_into(self, f, buffers: list, offset: int) -> int:
        raw = f.raw if isinstance(f, _CountedFile) else f
        n = super().read_into(raw, buffers, offset)
        self.count(getattr(f, "name", "?"), n)
        return n

    def data_bytes(self) -> int:
        return sum(n for name, n in self.counts.items() if name.endswith(".distcp"))

    def data_reads(self) -> int:
        """Read calls on data files."""
        return sum(n for name, n in self.calls.items() if name.endswith(".distcp"))
