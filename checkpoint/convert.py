"""Turn state-dict values (tensors, DTensors, flat-shard params, shards) into :class:`CheckpointShard`.

Everything a rank saves or loads goes through :func:`to_checkpointable`, so
every tensor, however it is sharded, is stored the same way: in its global
shape, as locally computed chunks of bounded size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Partial, Replicate

from checkpoint.shard import CheckpointShard
from offload_fsdp.grad import local_tensor
from offload_fsdp.shard_spec import ShardSpec, shard_spec_of

__all__ = ["StatefulPath", "convert_tree", "load_stateful", "resolve_stateful", "to_checkpointable"]


def to_checkpointable(
    value: Any,
    *,
    name: str,
    rank: int = 0,
    replicas_on_rank0_only: bool = False,
    max_chunk_bytes: int | None = None,
) -> Any:
    """``value`` as a :class:`CheckpointShard` if it is a tensor, else unchanged.

    * ``DTensor``: its local tensor at the box DTensor computes for this rank;
    * a tensor carrying a :class:`ShardSpec` (flat-shard params): that region;
    * any other tensor: the whole tensor (a replica on every rank).

    With ``replicas_on_rank0_only`` (scale mode, where there is no global plan
    to de-duplicate replicas) only one rank writes each replicated region.
    Loading writes into the local tensor in place.
    """
    if not isinstance(value, torch.Tensor):  # ShardedTensor and DTensor are tensors too
        return value
    if isinstance(value, CheckpointShard):
        if value.max_chunk_bytes == max_chunk_bytes:
            return value  # already converted (e.g. staged by an async save, which may be a gated subclass)
        return CheckpointShard(value.local, value.spec, writes=value.writes, max_chunk_bytes=max_chunk_bytes)
    if _is_sharded_tensor(value):
        return _from_sharded_tensor(value, name=name, max_chunk_bytes=max_chunk_bytes)
    if isinstance(value, DTensor):
        return _from_dtensor(
            value, name=name, replicas_on_rank0_only=replicas_on_rank0_only, max_chunk_bytes=max_chunk_bytes
        )
    try:
        spec = shard_spec_of(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from exc
    if spec is not None:
        if spec.is_flat and not value.is_contiguous():
            raise ValueError(f"{name}: a flat-range shard must be contiguous to be saved or loaded in place")
        return CheckpointShard(value.detach(), spec, max_chunk_bytes=max_chunk_bytes)
    spec = ShardSpec(tuple(value.shape), offsets=(0,) * value.dim())
    writes = rank == 0 or not replicas_on_rank0_only
    return CheckpointShard(value.detach(), spec, writes=writes, max_chunk_bytes=max_chunk_bytes)


def _from_dtensor(value: DTensor, *, name: str, replicas_on_rank0_only: bool, max_chunk_bytes: int | None):
    if any(isinstance(p, Partial) for p in value.placements):
        raise ValueError(f"{name}: a DTensor with Partial placements cannot be checkpointed; reduce it first")
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    local = local_tensor(value).detach()  # the same storage, so a load writes into the DTensor
    if coordinate is None:
        # This rank is not in the DTensor's mesh: it holds nothing of it.
        spec = ShardSpec(tuple(value.shape), offsets=(0,) * value.dim())
        return CheckpointShard(local.new_empty((0,) * value.dim()), spec, writes=False, max_chunk_bytes=max_chunk_bytes)
    (chunk,) = value.__create_chunk_list__()  # DTensor's checkpoint box of this rank: one local shard
    local_shape, offsets = chunk.sizes, chunk.offsets
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(f"{name}: DTensor local shape {tuple(local.shape)} is not the expected {tuple(local_shape)}")
    writes = True
    if replicas_on_rank0_only:
        # HSDP / replicate dims: the replica at coordinate 0 of every Replicate dim writes.
        writes = all(c == 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate))
    spec = ShardSpec(tuple(value.shape), offsets=tuple(offsets))
    return CheckpointShard(local, spec, writes=writes, max_chunk_bytes=max_chunk_bytes)


def _is_sharded_tensor(value: Any) -> bool:
    # ShardedTensor (FSDP1 / torchrec) has no public import path; its module is imported lazily
    # so checkpoint/ loads where torch.distributed._shard is absent
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return False
    return isinstance(value, ShardedTensor)


def _from_sharded_tensor(value: Any, *, name: str, max_chunk_bytes: int | None) -> CheckpointShard:
    """A ``ShardedTensor`` with at most one local shard, as that box of its global tensor."""
    shards = value.local_shards()
    global_shape = tuple(value.size())
    if len(shards) > 1:
        raise TypeError(
            f"{name}: a ShardedTensor with {len(shards)} local shards on this rank is not supported "
            "(one region per key and rank); pass each block under its own key as "
            "checkpoint.shard(block, global_shape, offsets=...), or convert it to a DTensor"
        )
    if not shards:
        spec = ShardSpec(global_shape, offsets=(0,) * len(global_shape))
        empty = torch.empty((0,) * len(global_shape), dtype=value.dtype)
        return CheckpointShard(empty, spec, writes=False, max_chunk_bytes=max_chunk_bytes)
    local = shards[0].tensor.detach()
    spec = ShardSpec(global_shape, offsets=tuple(shards[0].metadata.shard_offsets))
    return CheckpointShard(local, spec, max_chunk_bytes=max_chunk_bytes)


_NEVER_STATEFUL = frozenset({int, float, str, bool, bytes, type(None), tuple, list, torch.Tensor, dict})
"""Exact types tested before ``Stateful``: a runtime-Protocol ``isinstance`` costs ~50 us (it inspects the
class statically), which thousands of group options per save would pay."""


def _is_stateful(value: Any) -> bool:
    if type(value) in _NEVER_STATEFUL:
        return False
    return not isinstance(value, (torch.Tensor, dict)) and isinstance(value, Stateful)


StatefulPath = tuple[str | int, ...]
"""Where a Stateful sits: dict keys (as strings, as DCP flattens them) and list indices."""


def resolve_stateful(tree: Any, path: StatefulPath = ()) -> tuple[Any, list[tuple[StatefulPath, Any]]]:
    """``tree`` with every Stateful value (``state_dict()`` / ``load_state_dict()``) replaced by its state dict.

    Returns the new tree (dicts and lists copied, leaves shared) and ``(path, object)``
    for each Stateful found in dicts and lists, outermost first, so a load can hand
    each object its loaded state (:func:`load_stateful`), as ``dcp.load`` does.
    """
    if _is_stateful(tree):
        inner, below = resolve_stateful(tree.state_dict(), path)
        return inner, [(path, tree), *below]
    if isinstance(tree, tuple) and any(_is_stateful(v) for v in tree):
        # a tuple is one pickled value (as in DCP): its objects would be pickled whole and never loaded into
        stateful = next(v for v in tree if _is_stateful(v))
        raise TypeError(
            f"{'.'.join(map(str, path))}: a tuple holding a Stateful {type(stateful).__name__}; "
            "pass a list (or dict) so it is saved as its state_dict() and loaded in place"
        )
    found: list[tuple[StatefulPath, Any]] = []
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out[k], more = resolve_stateful(v, (*path, str(k)))
            found += more
        return out, found
    if isinstance(tree, list):
        items = []
        for i, v in enumerate(tree):
            value, more = resolve_stateful(v, (*path, i))
            items.append(value)
            found += more
        return items, found
    return tree, []


def load_stateful(tree: dict[str, Any], found: list[tuple[StatefulPath, Any]]) -> None:
    """Call ``load_state_dict`` on each object :func:`resolve_stateful` found, innermost first."""
    for path, obj in reversed(found):
        node: Any = tree
        for part in path:
            node = node[part]
        obj.load_state_dict(node)


def convert_tree(tree: Any, prefix: str = "", **kwargs) -> Any:
    """:func:`to_checkpointable` on every leaf of nested dicts (lists / tuples are leaves unless they hold tensors).

    A Stateful value (an ``nn.Module``, a dataloader) is saved as its ``state_dict()``.
    """
    if _is_stateful(tree):
        return convert_tree(tree.state_dict(), prefix, **kwargs)
    if isinstance(tree, dict):
        return {k: convert_tree(v, f"{prefix}{k}.", **kwargs) for k, v in tree.items()}
    if isinstance(tree, list) and any(isinstance(v, (torch.Tensor, dict)) or _is_stateful(v) for v in tree):
        return [convert_tree(v, f"{prefix}{i}.", **kwargs) for i, v in enumerate(tree)]
    return to_checkpointable(tree, name=prefix.rstrip("."), **kwargs)
