"""A committed checkpoint's files sent to another rank over torch.distributed, checked and committed there.

The sender reads the checkpoint's ``manifest.json`` and every file it lists, and sends them with
point-to-point ``isend`` (gloo or NCCL, whatever the group's backend is; no socket of our own): a
header (manifest length, total length), then one byte tensor. The receiver writes them into a
staging directory, checks every file against the manifest's sizes and CRC-32s (computed as the bytes are written), writes the manifest
last and swaps the directory into place (:mod:`checkpoint.atomic`): a copy is committed whole, or
refused with :class:`~checkpoint.errors.CheckpointCorruptError`, never half there.

Memory: one checkpoint's bytes per transfer on each side, while it runs.
A wait for a peer is bounded by the group's timeout (``dist.new_group(timeout=...)``): a peer
that never sends raises there instead of hanging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import PurePath

import torch
import torch.distributed as dist

from checkpoint.atomic import make_staging, swap_into_place, write_lock
from checkpoint.errors import CheckpointCorruptError
from checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest, write_manifest
from checkpoint.storage_backend import locate, storage_for

__all__ = ["Outgoing", "exchange", "read_checkpoint_bytes"]

_HEADER = 2  # manifest bytes, total bytes


@dataclass
class Outgoing:
    """One checkpoint on its way to ``to_rank``: the manifest's bytes followed by its files'."""

    to_rank: int
    payload: torch.Tensor
    manifest_bytes: int


def read_checkpoint_bytes(directory: str | os.PathLike, to_rank: int) -> Outgoing:
    """The committed checkpoint at ``directory`` as one byte tensor (manifest first, files in name order)."""
    directory = locate(directory)
    manifest = read_manifest(directory)
    store = storage_for(directory)
    parts = [_read(store, directory / MANIFEST_NAME)]
    parts += [_read(store, directory / name) for name in sorted(manifest.files)]
    payload = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    return Outgoing(to_rank, payload, len(parts[0]))


def _read(store, path: PurePath) -> bytes:
    with store.open_read(path) as f:
        return f.read()


def exchange(
    outgoing: list[Outgoing], incoming: dict[int, PurePath], *, group: dist.ProcessGroup | None, tag: int = 0
) -> None:
    """Send every ``outgoing`` checkpoint and receive one from each rank of ``incoming`` (source rank ->
    the path to commit it at). Every rank named on either side calls it at the same point.

    Raises ``RuntimeError`` (the group's timeout) when a source never sends, and
    :class:`~checkpoint.errors.CheckpointCorruptError` when what arrived does not match its manifest.
    """
    headers = [torch.tensor([o.manifest_bytes, o.payload.numel()], dtype=torch.int64) for o in outgoing]
    sends = [dist.isend(h, dst=o.to_rank, group=group, tag=tag) for h, o in zip(headers, outgoing)]
    sends += [dist.isend(o.payload, dst=o.to_rank, group=group, tag=tag + 1) for o in outgoing]
    try:
        for source, path in sorted(incoming.items()):
            _receive(source, path, group, tag)
    finally:
        for work in sends:
            if work is not None:  # None: this rank is not in the group (never the case here)
                work.wait()


def _receive(source: int, path: PurePath, group: dist.ProcessGroup | None, tag: int) -> None:
    header = torch.empty(_HEADER, dtype=torch.int64)
    _wait(dist.irecv(header, src=source, group=group, tag=tag), source, path)
    manifest_bytes, total = (int(x) for x in header)
    payload = torch.empty(total, dtype=torch.uint8)
    _wait(dist.irecv(payload, src=source, group=group, tag=tag + 1), source, path)
    commit_copy(path, payload.numpy().data, manifest_bytes, f"rank {source}")


def _wait(work, source: int, path: PurePath) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # gloo: a timeout or a peer that closed its connection
        raise RuntimeError(
            f"rank {source} did not send its copy of {path} ({' '.join(str(exc).split())[:200]}): "
            "its process is gone or stuck; the restore falls back"
        ) from exc


def commit_copy(path: PurePath, data: memoryview, manifest_bytes: int, origin: str) -> None:
    """Commit the checkpoint in ``data`` (manifest bytes, then the files in name order) at ``path``."""
    try:
        manifest = Manifest.from_json(bytes(data[:manifest_bytes]).decode("utf-8"), source=f"{origin}'s {path}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointCorruptError(f"the copy of {path} from {origin} has no valid manifest ({exc})") from None
    sizes = [(name, manifest.files[name].size) for name in sorted(manifest.files)]
    if manifest_bytes + sum(size for _, size in sizes) != len(data):
        raise CheckpointCorruptError(f"the copy of {path} from {origin} is {len(data)} bytes, its manifest disagrees")
    with write_lock(path):
        staged = make_staging(path)
        store = storage_for(staged)
        offset = manifest_bytes
        problems = []
        for name, size in sizes:
            out = store.create(staged / name)
            out.write(data[offset : offset + size])
            written = out.finish()  # its CRC-32, computed as the bytes went to the file
            offset += size
            if written.crc32 != manifest.files[name].crc32:
                problems.append(f"{name}: CRC-32 does not match the manifest")
        if problems:
            store.remove_tree(staged, ignore_errors=True)
            raise CheckpointCorruptError(f"the copy of {path} from {origin} is corrupt: " + "; ".join(problems[:3]))
        write_manifest(staged, manifest)
        swap_into_place(staged, path)
