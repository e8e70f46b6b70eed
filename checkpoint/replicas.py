"""Load once per replica: one replica group reads each byte from storage, the others receive it.

A DTensor placed ``Replicate()`` on a mesh dimension of size > 1 (HSDP's
replicate dimension, DDP over a :class:`~torch.distributed.device_mesh.DeviceMesh`)
holds the same local tensor on every rank along that dimension. Instead of
each of them reading those bytes, only the rank at coordinate 0 of every such
dimension reads them (:meth:`ReplicaShare.received` names what the others
skip), and :meth:`ReplicaShare.send` broadcasts them along each replicate
dimension in turn: after the broadcast along the k-th, every rank whose
coordinates on the later replicate dimensions are 0 holds the bytes, so after
the last every rank does.

What every rank loads whole (plain tensors such as AdamW's ``step``, and
non-tensor values) travels the same way, along :func:`replica_dims`: the
replicate dimensions of the first replicated DTensor's mesh (of the whole
load, found once) when that mesh spans every loading rank. A receiving
replica then opens no data file at all (a file one rank reads
from is read whole by the streamed CRC-32 check). Tensors that differ by rank
without a mesh (flat shards, :class:`~checkpoint.shard.CheckpointShard`) are
read by each rank itself.

Tensor bytes travel in buckets of at most ``bucket_bytes`` (one broadcast per
bucket, not per tensor), in key order, the same on every rank: a
precondition is that every rank loads the same keys, as SPMD code does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from checkpoint.shard import CheckpointShard
from offload_fsdp.grad import local_tensor
from offload_fsdp.shard_spec import shard_spec_of

__all__ = ["ReplicaDims", "ReplicaShare", "replica_dims"]

_ALIGN = 16  # every tensor starts at a multiple of its itemsize within a bucket, so its bytes view as its dtype


@dataclass(frozen=True)
class ReplicaDims:
    """Mesh dimensions a value is replicated along (each of size > 1)."""

    mesh: Any
    dims: tuple[int, ...]

    def reads(self) -> bool:
        """This rank is at coordinate 0 of every one of them: it reads, the others receive."""
        coordinate = self.mesh.get_coordinate()
        return all(coordinate[d] == 0 for d in self.dims)

    def source(self, dim: int) -> tuple[bool, int, dist.ProcessGroup]:
        """Along ``dim``: whether this rank sends, the global rank that does (coordinate 0), and the group."""
        coordinate = list(self.mesh.get_coordinate())
        sends = coordinate[dim] == 0
        coordinate[dim] = 0
        return sends, int(self.mesh.mesh[tuple(coordinate)]), self.mesh.get_group(dim)


class ReplicaShare:
    """The replicated values of one load: which this rank reads, and the broadcasts that fill the rest."""

    def __init__(
        self,
        tensors: dict[str, tuple[torch.Tensor, ReplicaDims]],
        values: list[str],
        along: ReplicaDims | None,
        bucket_bytes: int,
    ) -> None:
        self._tensors = tensors
        self._values = values
        self._along = along
        self._bucket_bytes = max(bucket_bytes, 1)

    @classmethod
    def of(cls, targets: dict[str, Any], *, shared: ReplicaDims | None, bucket_bytes: int) -> ReplicaShare | None:
        """The replicated values among ``targets`` (key -> value), or ``None`` when nothing is replicated.

        ``shared``: the dimensions what every rank loads whole travels along (:func:`replica_dims`).
        """
        tensors: dict[str, tuple[torch.Tensor, ReplicaDims]] = {}
        values: list[str] = []
        replicated = False
        for key in sorted(targets):
            value = targets[key]
            along = _replicated_along(value)
            if along is not None:
                replicated = True  # decided from placements: the same on every rank, in the mesh or not
                if along.mesh.get_coordinate() is not None:  # a rank outside the mesh holds nothing of it
                    tensors[key] = (local_tensor(value).detach(), along)
            elif shared is not None and not isinstance(value, torch.Tensor):
                values.append(key)
            elif shared is not None and _whole_on_every_rank(value):
                tensors[key] = (value.detach(), shared)
        if not (replicated or values or tensors):
            return None
        return cls(tensors, values, shared, bucket_bytes)

    def received(self) -> set[str]:
        """Keys this rank receives instead of reading."""
        received = {key for key, (_, along) in self._tensors.items() if not along.reads()}
        if self._along is not None and not self._along.reads():
            received.update(self._values)
        return received

    def send(self, loaded: dict[str, Any]) -> None:
        """Broadcast what was read to the other replicas; non-tensor values are set in ``loaded`` (key -> value).

        Every rank calls it, once every rank's reads succeeded (a rank that failed
        to read would leave the others waiting here).
        """
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t, along in self._tensors.values():
            groups.setdefault((along, t.device), []).append(t)
        for (along, _), tensors in groups.items():
            for dim in along.dims:
                for bucket in self._buckets(tensors):
                    _broadcast(bucket, *along.source(dim))
        if self._values and self._along is not None:
            for dim in self._along.dims:
                sends, source, group = self._along.source(dim)
                box: list[dict[str, Any] | None] = [{key: loaded[key] for key in self._values} if sends else None]
                # values loaded by the weights-only reader of a rank of this job: pickled between ranks
                dist.broadcast_object_list(box, src=source, group=group)
                loaded.update(box[0] or {})

    def _buckets(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for t in tensors:
            if buckets[-1] and size + _padded(t) > self._bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += _padded(t)
        return buckets


def replica_dims(values: Iterable[Any], group: dist.ProcessGroup | None) -> ReplicaDims | None:
    """The replicate dimensions of the first replicated DTensor among ``values`` whose mesh spans every rank
    of ``group``: what every rank loads whole is read once along them; ``None`` when there is none."""
    world_size = dist.get_world_size(group)
    for value in values:
        along = _replicated_along(value)
        if along is not None and along.mesh.size() == world_size and along.mesh.get_coordinate() is not None:
            return along
    return None


def _replicated_along(value: Any) -> ReplicaDims | None:
    if not isinstance(value, DTensor):
        return None
    mesh = value.device_mesh
    dims = tuple(d for d, p in enumerate(value.placements) if isinstance(p, Replicate) and mesh.size(d) > 1)
    return ReplicaDims(mesh, dims) if dims else None


def _whole_on_every_rank(value: torch.Tensor) -> bool:
    """A plain tensor loaded whole (not a shard of something: those differ by rank)."""
    return not isinstance(value, (DTensor, CheckpointShard)) and shard_spec_of(value) is None


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


def _broadcast(bucket: list[torch.Tensor], sends: bool, source: int, group: dist.ProcessGroup) -> None:
    """One broadcast of the bucket's bytes from global rank ``source`` over ``group``."""
    buffer = torch.empty(sum(_padded(t) for t in bucket), dtype=torch.uint8, device=bucket[0].device)
    spans = []
    start = 0
    for t in bucket:
        spans.append((t, buffer[start : start + t.numel() * t.element_size()]))
        start += _padded(t)
    if sends:
        for t, span in spans:
            span.copy_(t.reshape(-1).contiguous().view(torch.uint8))
    dist.broadcast(buffer, src=source, group=group)
    if not sends:
        for t, span in spans:
            t.copy_(span.view(t.dtype).view(t.shape))
