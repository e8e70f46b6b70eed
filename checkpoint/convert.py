"""Turn state-dict values (tensors, DTensors, flat-shard params, shards) into :class:`CheckpointShard`.

Everything a rank saves or loads goes through :func:`to_checkpointable`, so
every tensor, however it is sharded, is stored the same way: in its global
shape, as locally computed chunks of bounded size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Partial, Replicate

from checkpoint.shard import CheckpointShard
from offload_fsdp.grad import local_tensor
from offload_fsdp.shard_spec import ShardSpec, attach_shard_spec, shard_spec_of

__all__ = [
    "StatefulPath",
    "assign_back",
    "convert_tree",
    "flatten_state_dict",
    "is_one_chunk",
    "load_stateful",
    "materialize_meta",
    "resolve_stateful",
    "to_checkpointable",
]


_PLAIN_VALUES = frozenset({int, float, str, bool, bytes, type(None), tuple, list, dict})


def to_checkpointable(
    value: Any,
    *,
    name: str,
    rank: int = 0,
    replicas_on_rank0_only: bool = False,
    max_chunk_bytes: int | None = None,
    whole_as_is: bool = False,
) -> Any:
    """``value`` as a :class:`CheckpointShard` if it is a tensor, else unchanged.

    * ``DTensor``: its local tensor at the box DTensor computes for this rank;
    * any other value implementing DCP's checkpointable protocol
      (``__create_chunk_list__`` / ``__get_tensor_shard__``: a tensor subclass, a
      ``DTensor`` over a ``LocalShardsWrapper``): the one chunk it lists on this rank
      (none: an empty shard); several chunks on one rank are refused (``TypeError``);
    * a tensor carrying a :class:`ShardSpec` (flat-shard params): that region;
    * any other tensor: the whole tensor (a replica on every rank).

    With ``replicas_on_rank0_only`` (scale mode, where there is no global plan
    to de-duplicate replicas) only one rank writes each replicated region.
    ``whole_as_is``: a plain tensor stored whole as one chunk (no ``ShardSpec``, within
    ``max_chunk_bytes``) is returned as it is, for a writer that stores such a tensor itself
    (:mod:`checkpoint.save_plan`: the wrapper costs ~25 us a tensor, most of a small tensor's save).
    Loading writes into the local tensor in place.
    """
    if type(value) in _PLAIN_VALUES:  # most leaves (a group's options per parameter): skip the protocol checks
        return value
    if type(value) is torch.Tensor:  # exactly a plain tensor: none of the kinds below, only a ShardSpec to look for
        if whole_as_is and is_one_chunk(value, max_chunk_bytes, name=name):
            return value
        return _from_tensor(
            value, name=name, rank=rank, replicas_on_rank0_only=replicas_on_rank0_only, max_chunk_bytes=max_chunk_bytes
        )
    if isinstance(value, CheckpointShard):
        if value.max_chunk_bytes == max_chunk_bytes:
            return value  # already converted (e.g. staged by an async save, which may be a gated subclass)
        return CheckpointShard(value.local, value.spec, writes=value.writes, max_chunk_bytes=max_chunk_bytes)
    if _is_sharded_tensor(value):
        return _from_sharded_tensor(value, name=name, max_chunk_bytes=max_chunk_bytes)
    if isinstance(value, DTensor) and not _is_checkpointable(local_tensor(value)):
        return _from_dtensor(
            value, name=name, replicas_on_rank0_only=replicas_on_rank0_only, max_chunk_bytes=max_chunk_bytes
        )
    if _is_checkpointable(value):
        return _from_checkpointable(value, name=name, max_chunk_bytes=max_chunk_bytes)
    if not isinstance(value, torch.Tensor):
        return value
    return _from_tensor(
        value, name=name, rank=rank, replicas_on_rank0_only=replicas_on_rank0_only, max_chunk_bytes=max_chunk_bytes
    )


def is_one_chunk(value: torch.Tensor, max_chunk_bytes: int | None, *, name: str) -> bool:
    """Whether the plain tensor ``value`` is stored whole, as one chunk (no ``ShardSpec``, within the bound);
    a malformed shard description is an error naming ``name``."""
    fits = max_chunk_bytes is None or value.numel() * value.element_size() <= max_chunk_bytes
    return fits and _spec_of(value, name=name) is None


def _spec_of(value: torch.Tensor, *, name: str) -> ShardSpec | None:
    try:
        return shard_spec_of(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from exc


def _from_tensor(
    value: torch.Tensor, *, name: str, rank: int, replicas_on_rank0_only: bool, max_chunk_bytes: int | None
) -> CheckpointShard:
    """A tensor that is none of the kinds above: its :class:`ShardSpec`'s region, or the whole tensor."""
    spec = _spec_of(value, name=name)
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


def materialize_meta(value: Any, *, name: str, device: torch.device) -> Any:
    """``value`` as a fresh, uninitialised tensor of the same kind on ``device`` if it is on the meta device, else itself.

    What ``dcp.load`` does to a meta-device target before reading into it (a model
    built on ``meta`` is how large models are loaded): a tensor, a ``DTensor``
    (same mesh, placements and global shape, uneven shards included), a
    :class:`CheckpointShard` or a flat-shard tensor (its :class:`ShardSpec` kept).
    """
    if not isinstance(value, torch.Tensor) or value.device.type != "meta":
        return value
    if isinstance(value, CheckpointShard):
        local = torch.empty_like(value.local, device=device)
        return CheckpointShard(local, value.spec, writes=value.writes, max_chunk_bytes=value.max_chunk_bytes)
    if isinstance(value, DTensor) and not _is_checkpointable(local_tensor(value)):
        return DTensor.from_local(
            torch.empty_like(local_tensor(value), device=device),
            value.device_mesh,
            value.placements,
            # given, not inferred: the local shapes of an uneven sharding do not determine them
            shape=value.shape,
            stride=value.stride(),
        )
    if _is_checkpointable(value):
        raise TypeError(
            f"{name}: a {type(value).__name__} on the meta device cannot be materialised here (its shards are its "
            "own); create it on a real device before loading into it"
        )
    spec = shard_spec_of(value)
    out = torch.empty_like(value, device=device)
    return out if spec is None else attach_shard_spec(out, spec, name=name)


_PROTOCOL = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")


def _is_checkpointable(value: Any) -> bool:
    """A value that describes its own shards through DCP's checkpointable protocol (TorchRec-style shards)."""
    return not isinstance(value, CheckpointShard) and all(hasattr(value, m) for m in _PROTOCOL)


def _from_checkpointable(value: Any, *, name: str, max_chunk_bytes: int | None) -> CheckpointShard:
    """A checkpointable value (a DTensor forwards to its local tensor's protocol) as its one chunk on this rank.

    ``__get_tensor_shard__`` gives the chunk's data (a load writes into it, as
    ``dcp.load`` does). One region per key and rank is what this format stores
    without a global plan, so several chunks on one rank are refused.
    """
    if isinstance(value, DTensor) and any(isinstance(p, Partial) for p in value.placements):
        raise ValueError(f"{name}: a DTensor with Partial placements cannot be checkpointed; reduce it first")
    global_shape = tuple(value.shape)
    origin = (0,) * len(global_shape)
    if math.prod(global_shape) == 0:  # no elements: one empty chunk records its key and shape
        empty = torch.empty(global_shape, dtype=value.dtype)
        return CheckpointShard(empty, ShardSpec(global_shape, offsets=origin), max_chunk_bytes=max_chunk_bytes)
    # (index in the value's own list, chunk): the index is the protocol's lookup hint
    chunks = [(i, c) for i, c in enumerate(value.__create_chunk_list__()) if math.prod(c.sizes) > 0]
    if len(chunks) > 1:
        raise TypeError(
            f"{name}: a {type(value).__name__} with {len(chunks)} chunks on this rank is not supported "
            "(one region per key and rank); pass each chunk under its own key as "
            "checkpoint.shard(chunk, global_shape, offsets=...), or save it with plain torch.distributed.checkpoint"
        )
    if not chunks:  # an empty shard: this rank holds nothing of it
        empty = torch.empty((0,) * len(global_shape), dtype=value.dtype)
        return CheckpointShard(
            empty, ShardSpec(global_shape, offsets=origin), writes=False, max_chunk_bytes=max_chunk_bytes
        )
    index, chunk = chunks[0]
    local = value.__get_tensor_shard__(MetadataIndex(name, chunk.offsets, index))
    plain = isinstance(local, torch.Tensor) and not isinstance(local, DTensor) and not _is_checkpointable(local)
    if not plain or tuple(local.shape) != tuple(chunk.sizes):
        raise TypeError(
            f"{name}: {type(value).__name__}.__get_tensor_shard__ returned a {type(local).__name__} of shape "
            f"{tuple(getattr(local, 'shape', ()))} for its chunk of size {tuple(chunk.sizes)}; it must return "
            "the chunk's data as a plain tensor"
        )
    return CheckpointShard(
        local.detach(), ShardSpec(global_shape, offsets=tuple(chunk.offsets)), max_chunk_bytes=max_chunk_bytes
    )


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


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})
"""Exact types of leaves that are saved as they are: nothing to resolve, convert or check per value."""

_LEAVES = _SCALARS | {torch.Tensor}
"""Exact types of leaves that are never Stateful: nothing to resolve in them."""

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

    Returns the new tree (dicts and lists copied in their own order, leaves shared)
    and ``(path, object)`` for each Stateful found in dicts and lists, outermost
    first. Dict entries are visited in sorted key order, so every rank calls the
    objects' ``state_dict()`` in the same order whatever its dicts' insertion order
    (they may run collectives); :func:`load_stateful` then hands each object its
    loaded state, in the order ``dcp.load`` does. A list of plain values referenced from several places is
    copied once, the copy referenced likewise: torch's flattened optimizer layout references a group's
    ``param_names`` (every name) from each parameter's key, which copied per key would cost O(N^2).
    """
    return _resolve(tree, path, {})


def _resolve(tree: Any, path: StatefulPath, plain_lists: dict[int, list]) -> tuple[Any, list[tuple[StatefulPath, Any]]]:
    """:func:`resolve_stateful`; ``plain_lists``: id of a list of plain values met already -> its copy."""
    if _is_stateful(tree):
        inner, below = _resolve(tree.state_dict(), path, plain_lists)
        return inner, [(path, tree), *below]
    if isinstance(tree, tuple) and any(_is_stateful(v) for v in tree):
        # a tuple is one pickled value (as in DCP): its objects would be pickled whole and never loaded into
        stateful = next(v for v in tree if _is_stateful(v))
        raise TypeError(
            f"{'.'.join(map(str, path))}: a tuple holding a Stateful {type(stateful).__name__}; "
            "pass a list (or dict) so it is saved as its state_dict() and loaded in place"
        )
    found: list[tuple[StatefulPath, Any]] = []
    if type(tree) is dict and all(type(v) in _LEAVES for v in tree.values()):
        return dict(tree), found  # a param's state or its group's options: nothing to resolve (the common case)
    if isinstance(tree, dict):
        out = {}
        for k in _sorted_keys(tree):
            value = tree[k]
            if type(value) in _LEAVES:
                out[k] = value
                continue
            out[k], more = _resolve(value, (*path, str(k)), plain_lists)
            found += more
        return {k: out[k] for k in tree}, found
    if type(tree) is list:
        copied = plain_lists.get(id(tree))  # the caller's tree keeps ``tree`` alive: its id is not reused
        if copied is None and all(type(v) in _SCALARS for v in tree):
            copied = plain_lists[id(tree)] = list(tree)
        if copied is not None:
            return copied, found
    if isinstance(tree, list):
        items = []
        for i, v in enumerate(tree):
            value, more = _resolve(v, (*path, i), plain_lists)
            items.append(value)
            found += more
        return items, found
    return tree, []


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """DCP's key flattening (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``, torch >= 2.4):
    the flat dict (dotted keys) and each key's nested path, in time linear in the tree.

    As DCP: dicts are walked, a list only if it holds a tensor or a dict (or such a list), its items keyed
    by index; any other value is one key. DCP's own decides that for a list at each reference to it,
    walking it each time: O(N^2) for torch's flattened optimizer layout, which references a group's
    ``param_names`` (every name) from each parameter's key. Here once per list object.
    """
    flat: dict[str, Any] = {}
    paths: dict[str, tuple] = {}
    walked: dict[int, bool] = {}  # id of a list -> whether it is walked (the tree keeps it alive meanwhile)

    def is_walked(value: Any) -> bool:
        if isinstance(value, Mapping):
            return True
        if not isinstance(value, list):
            return False
        known = walked.get(id(value))
        if known is None:
            known = walked[id(value)] = any(
                isinstance(item, torch.Tensor) or (isinstance(item, (Mapping, list)) and is_walked(item))
                for item in value
            )
        return known

    def visit(path: tuple, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif not is_walked(value):
            key = ".".join(map(str, path))
            if key in flat:
                raise ValueError(f"duplicated flatten key {key}")
            flat[key] = value
            paths[key] = path
        else:
            for i, v in enumerate(value):
                visit((*path, i), v)

    for key, value in state_dict.items():
        visit((str(key),), value)
    return flat, paths


def _sorted_keys(tree: dict) -> list:
    """``tree``'s keys in an order every rank agrees on, whatever the order they were inserted in (DCP's keys are strings)."""
    if all(type(k) is str for k in tree):
        return sorted(tree)  # the same order as below, without a Python call per key
    return sorted(tree, key=lambda k: (type(k).__name__, str(k)))


def _load_order(path: StatefulPath) -> tuple:
    """Sort key: ascending paths (``dcp.load``'s sorted keys), an object after everything inside it."""
    return (*((0, p) if isinstance(p, int) else (1, p) for p in path), (2,))


def load_stateful(tree: dict[str, Any], found: list[tuple[StatefulPath, Any]]) -> None:
    """Call ``load_state_dict`` on each object :func:`resolve_stateful` found, with its state from ``tree``.

    In sorted path order, the same on every rank whatever its dicts' insertion
    order (an object's ``load_state_dict`` may run collectives: ranks calling
    them in different orders would wait for each other forever), an object
    after the objects inside its state: the order ``dcp.load`` uses for top-level keys.
    """
    for path, obj in sorted(found, key=lambda item: _load_order(item[0])):
        node: Any = tree
        for part in path:
            node = node[part]
        obj.load_state_dict(node)


def assign_back(state_dict: dict[str, Any], resolved: dict[str, Any], found: list[tuple[StatefulPath, Any]]) -> None:
    """``state_dict[key] = loaded`` for every top-level entry that is not Stateful, as ``dcp.load`` does.

    ``resolved`` is :func:`resolve_stateful`'s tree after the load. A container
    stays the caller's own object (filled in place); a leaf is the loaded value
    (a non-tensor value, a materialised meta-device tensor, or the same tensor).
    """
    stateful = {path for path, _ in found}
    for key in _sorted_keys(state_dict):
        if (str(key),) not in stateful:
            value = state_dict[key]
            state_dict[key] = value if isinstance(value, (dict, list)) else resolved[key]


def convert_tree(tree: Any, prefix: str = "", **kwargs) -> Any:
    """:func:`to_checkpointable` on every leaf of nested dicts (lists / tuples are leaves unless they hold tensors).

    A Stateful value (an ``nn.Module``, a dataloader) is saved as its ``state_dict()``. Whether a list is
    walked is decided once per list object, however often it is referenced (torch's flattened optimizer
    layout references a group's ``param_names`` from each parameter's key: O(N^2) if decided per reference).
    """
    return _convert(tree, prefix, kwargs, {})


def _convert(tree: Any, prefix: str, kwargs: dict[str, Any], walked: dict[int, bool]) -> Any:
    """:func:`convert_tree`; ``walked``: id of a list met already -> whether it is walked (the tree keeps it alive)."""
    if _is_stateful(tree):
        return _convert(tree.state_dict(), prefix, kwargs, walked)
    if isinstance(tree, dict):
        # sorted: Stateful values' state_dict() in the same order on every rank (see resolve_stateful)
        converted = {
            k: v if type(v) in _SCALARS else _convert(v, f"{prefix}{k}.", kwargs, walked)
            for k in _sorted_keys(tree)
            for v in (tree[k],)
        }
        return {k: converted[k] for k in tree}  # the state dict's own order: the plan's and the files' order
    if isinstance(tree, list) and _holds_tensors(tree, walked):
        return [_convert(v, f"{prefix}{i}.", kwargs, walked) for i, v in enumerate(tree)]
    return to_checkpointable(tree, name=prefix.rstrip("."), **kwargs)


def _holds_tensors(items: list, walked: dict[int, bool]) -> bool:
    """Whether :func:`convert_tree` walks ``items``: it holds a tensor, a dict or a Stateful value."""
    known = walked.get(id(items))
    if known is None:
        known = walked[id(items)] = any(isinstance(v, (torch.Tensor, dict)) or _is_stateful(v) for v in items)
    return known
