"""The ``fsdp_dtensor`` format as DCP ``StorageWriter`` / ``StorageReader`` classes, for code that calls DCP.

Code written against ``torch.distributed.checkpoint`` (torchtitan style) keeps
its calls and gets this library's format, locally or at a URL::

    dcp.save(state_dict, storage_writer=checkpoint.FsdpStorageWriter("s3://bucket/run/step100"))
    dcp.load(state_dict, storage_reader=checkpoint.FsdpStorageReader("s3://bucket/run/step100"))

The writer commits as :func:`checkpoint.save_state_dict` does (manifest last;
renames and a lock on a local path, the object-store protocol at a URL) and
the checkpoint it writes is an ordinary one: ``checkpoint.load``, ``fsdp-ckpt``
and plain DCP read it. DCP's default planner is used as the caller passes it:
chunks are the tensors' own (no flat-shard conversion, which
:func:`checkpoint.save_state_dict` adds), and DCP's load planner unpickles
non-tensor values itself; :func:`checkpoint.load_state_dict` reads them with
the restricted unpickler instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import PurePath
from typing import Any

# _StoragePrefix: what FileSystemWriter puts in a SavePlan's storage_data (the rank's file prefix; no
# public name); renamed -> import fails (see checkpoint.storage, which names it too)
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan
from torch.futures import Future

from checkpoint.commit import commit_staged
from checkpoint.object_commit import protocol_for
from checkpoint.opener import open_checkpoint
from checkpoint.reader import DirectReader
from checkpoint.storage import FsdpWriter
from checkpoint.storage_backend import locate

__all__ = ["FsdpStorageReader", "FsdpStorageWriter"]


@dataclasses.dataclass
class _StagedPrefix(_StoragePrefix):
    """A rank's file prefix plus the name of the save's staging directory, chosen by the coordinator."""

    staging: str = ""


class FsdpStorageWriter(FsdpWriter):
    """A DCP ``StorageWriter`` writing one committed ``fsdp_dtensor`` checkpoint at ``path`` (local or a URL).

    The coordinator begins the save in DCP's local-plan step (lock, target check, staging directory) and
    sends the staging directory's name to every rank in the global plan; it commits in ``finish``. A save
    that fails leaves its staging to the next save, which removes it; the lock is released with the writer.
    """

    def __init__(self, path: str | os.PathLike, *, storage_options: dict | None = None) -> None:
        self.target = locate(path, storage_options)
        self._protocol = protocol_for(self.target)
        self._held = contextlib.ExitStack()
        self._world_size = 1
        self.staged: PurePath = self.target  # the staging directory, once the save began
        super().__init__(self.target, prepare=self._begin, on_commit=self._commit)

    def _begin(self) -> None:
        self.staged = self.path = self._protocol.begin(self._held)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        self._world_size = len(plans)  # one plan per rank: what the manifest records as the world size
        return [
            dataclasses.replace(p, storage_data=_StagedPrefix(p.storage_data.prefix, self.staged.name)) for p in plans
        ]

    def write_data(self, plan: SavePlan, planner: Any) -> Future:
        self.staged = self.path = self._protocol.staged(plan.storage_data.staging)
        return super().write_data(plan, planner)

    def _commit(self, metadata: Metadata, files: dict) -> None:
        try:
            info = {"mode": "collective", "writer": type(self).__name__}
            commit_staged(
                self.target,
                metadata,
                files,
                self._world_size,
                extra_info=info,
                staged=self.staged,
                protocol=self._protocol,
            )
        finally:
            self._held.close()  # the write lock of a local path

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._held.close()  # a failed save: DCP never calls finish


class FsdpStorageReader(DirectReader):
    """A DCP ``StorageReader`` for a committed checkpoint at ``path`` (local or a URL), checks included.

    Opens it as :func:`checkpoint.open_checkpoint` does (manifest, sizes, ``.metadata``'s CRC-32, the
    restricted unpickler for ``.metadata``) and checks the CRC-32 of every byte read as it streams in.
    """

    def __init__(self, path: str | os.PathLike, *, storage_options: dict | None = None, verify: str = "crc") -> None:
        self.opened = open_checkpoint(path, verify=verify, storage_options=storage_options)
        super().__init__(self.opened.path, self.opened.metadata, check=self.opened.content_check())

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with self.opened.reading():
            future = super().read_data(plan, planner)
            if self._check is not None:
                self._check.finish()  # raises naming the object whose bytes did not match
        return future
