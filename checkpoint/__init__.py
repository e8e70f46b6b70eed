"""The ``fsdp_dtensor`` checkpoint format on top of torch.distributed.checkpoint.

Everyday use::

    checkpoint.save(path, model=model, optimizer=opt, extra={"step": step})
    extra = checkpoint.load(path, model=model, optimizer=opt)      # any world size / layout

Lower level: :func:`save_state_dict` / :func:`load_state_dict` for any nested
dict of tensors, DTensors, flat-shard tensors and :func:`shard` objects.

Writing a checkpoint laid out for M ranks from one process (what
``fsdp-ckpt reshard`` / ``import`` use), or from each rank without any
collective::

    for rank in range(M):
        checkpoint.write_rank(path, rank, M, state_dict_of_rank)   # values may be shard(...) objects
    checkpoint.commit(path, M)

See :mod:`checkpoint.atomic` for the crash-safe replace of an existing
checkpoint and :mod:`checkpoint.layout` for how regions become chunks.
:func:`async_save` keeps its host staging buffers for the next async save;
:func:`release_staging_buffers` frees them. :class:`TieredCheckpointer` saves every few steps to a
node-local tier replicated to peer nodes, and every many steps to durable storage (:mod:`checkpoint.tiered`).
"""

from checkpoint.api import LoadResult, async_save, load, save
from checkpoint.async_save import AsyncSaveError, release_staging_buffers, wait_for_async_save
from checkpoint.commit import DEFAULT_MAX_CHUNK_BYTES, commit, merge_metadata, write_rank
from checkpoint.dcp_storage import FsdpStorageReader, FsdpStorageWriter
from checkpoint.durable import DiskFullError
from checkpoint.errors import LoadTargetError
from checkpoint.manifest import FORMAT_VERSION, Manifest, NotACheckpointError, read_manifest
from checkpoint.object_commit import ConcurrentSaveError, collect_garbage, resolve_for_load
from checkpoint.retention import committed_checkpoints, latest, retain
from checkpoint.save_errors import CheckpointLoadError, CheckpointSaveError
from checkpoint.shard import CheckpointShard, shard
from checkpoint.state_dict_io import (
    CheckpointCorruptError,
    LoadReport,
    OpenCheckpoint,
    load_state_dict,
    open_checkpoint,
    save_state_dict,
)
from checkpoint.storage_backend import SharedFileSystemStorage, Storage, locate, mount, unmount
from checkpoint.tiered import Restored, TieredCheckpointer

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "FORMAT_VERSION",
    "AsyncSaveError",
    "CheckpointCorruptError",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "CheckpointShard",
    "ConcurrentSaveError",
    "DiskFullError",
    "FsdpStorageReader",
    "FsdpStorageWriter",
    "LoadReport",
    "LoadResult",
    "LoadTargetError",
    "Manifest",
    "NotACheckpointError",
    "OpenCheckpoint",
    "Restored",
    "SharedFileSystemStorage",
    "Storage",
    "TieredCheckpointer",
    "async_save",
    "collect_garbage",
    "commit",
    "committed_checkpoints",
    "latest",
    "load",
    "load_state_dict",
    "locate",
    "merge_metadata",
    "mount",
    "open_checkpoint",
    "read_manifest",
    "release_staging_buffers",
    "resolve_for_load",
    "retain",
    "save",
    "save_state_dict",
    "shard",
    "unmount",
    "wait_for_async_save",
    "write_rank",
]
