"""A local tensor described as one region of a global tensor, checkpointable through DCP.

:class:`CheckpointShard` is a tensor subclass whose *shape is the global
shape* and which holds a rank's local data plus a :class:`~offload_fsdp.shard_spec.ShardSpec`.
It implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) as methods, so plain
``torch.distributed.checkpoint.save`` / ``load`` accept it too, and it pickles
(no closures). Chunk metadata is computed from the spec alone: no
communication, whatever the layout.

It is a description, not a tensor to compute with: any torch operation on it
raises ``TypeError``; use ``.local`` for the data.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from checkpoint.layout import Box, box_flat_start, region_boxes, split_box
from offload_fsdp.shard_spec import ShardSpec

__all__ = ["CheckpointShard", "shard"]


class CheckpointShard(torch.Tensor):
    """``local`` placed in a global tensor of ``spec.global_shape``; see :func:`shard`."""

    local: torch.Tensor
    spec: ShardSpec
    writes: bool
    max_chunk_bytes: int | None
    _boxes: list[Box]
    _chunks: list[Box]
    _by_offset: dict[tuple[int, ...], Box]

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        spec: ShardSpec,
        *,
        writes: bool = True,
        max_chunk_bytes: int | None = None,
    ) -> CheckpointShard:
        spec.check_local(local)
        # torch's documented way to build a wrapper tensor subclass (no public name); renamed -> saves fail
        self = torch.Tensor._make_wrapper_subclass(
            cls, spec.global_shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        self.local = local
        self.spec = spec
        self.writes = writes
        self.max_chunk_bytes = max_chunk_bytes
        self._boxes = _local_boxes(local, spec)
        self._chunks = [c for b in self._boxes for c in split_box(b, local.element_size(), max_chunk_bytes)]
        self._by_offset = {c.offsets: c for c in self._chunks}
        return self

    def __init__(self, *args, **kwargs) -> None:  # __new__ did the work
        pass

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self.local, self.spec, self.writes, self.max_chunk_bytes))

    # mypy reports even Tensor.__repr__'s own signature as incompatible (torch's partly typed Tensor)
    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"CheckpointShard(global_shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"local_shape={tuple(self.local.shape)}, spec={self.spec}, chunks={len(self._chunks)})"
        )

    @classmethod  # torch's stub types the base as a plain function; torch documents a classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise TypeError(
            f"{func} on a CheckpointShard: it only describes where a local tensor sits in a global "
            "one for checkpointing; use `.local` to compute with the data"
        )

    @property
    def chunks(self) -> list[Box]:
        """The boxes this shard is stored as (after the chunk-size bound)."""
        return list(self._chunks)

    # --- DCP's checkpointable protocol -----------------------------------------------------------

    def __create_write_items__(self, fqn: str, object: object) -> list[WriteItem]:
        if not self.writes:
            return []
        # dtype only: pinned-ness or requires_grad would make equal states save differently.
        properties = TensorProperties(dtype=self.dtype)
        size = torch.Size(self.spec.global_shape)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                    properties=properties,
                    size=size,
                ),
            )
            for chunk in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        chunk = self._by_offset.get(tuple(index.offset)) if index.offset is not None else None
        if chunk is None:
            raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {index.offset}")
        return local_view(self.local, self.spec, chunk)


def _rebuild(local, spec, writes, max_chunk_bytes) -> CheckpointShard:
    return CheckpointShard(local, spec, writes=writes, max_chunk_bytes=max_chunk_bytes)


def _local_boxes(local: torch.Tensor, spec: ShardSpec) -> list[Box]:
    if spec.flat_start is not None:
        return region_boxes(spec.global_shape, flat_start=spec.flat_start, local_numel=local.numel())
    assert spec.offsets is not None  # a ShardSpec is a flat range or a box
    if math.prod(spec.global_shape) == 0:
        # A tensor with no elements still needs one (empty) chunk so its key and shape are stored.
        return [Box(spec.offsets, tuple(local.shape))]
    return region_boxes(spec.global_shape, offsets=spec.offsets, local_shape=tuple(local.shape))


def local_view(local: torch.Tensor, spec: ShardSpec, box: Box) -> torch.Tensor:
    """The part of ``local`` that holds ``box`` of the global tensor, as a view of shape ``box.sizes``.

    Precondition: ``box`` lies inside the region ``spec`` gives ``local``. For a
    flat range the box is a contiguous run (see :mod:`checkpoint.layout`).
    """
    if spec.flat_start is not None:
        start = box_flat_start(spec.global_shape, box) - spec.flat_start
        return local.reshape(-1)[start : start + math.prod(box.sizes)].view(box.sizes)
    assert spec.offsets is not None  # a ShardSpec is a flat range or a box
    view = local
    for dim, (o, s, lo) in enumerate(zip(box.offsets, box.sizes, spec.offsets)):
        view = view.narrow(dim, o - lo, s)
    return view


def shard(
    local: torch.Tensor,
    global_shape: tuple[int, ...] | torch.Size,
    *,
    offsets: tuple[int, ...] | None = None,
    flat_start: int | None = None,
    max_chunk_bytes: int | None = None,
) -> CheckpointShard:
    """Describe ``local`` as one region of a global tensor of ``global_shape``.

    Either a box at ``offsets`` (``local`` has the global rank), or the flat
    range ``[flat_start, flat_start + local.numel())`` of the global row-major
    order (``local`` of any shape, contiguous). With neither, ``local`` is the
    whole tensor (offsets 0). Usable as a state-dict value for
    :func:`checkpoint.save_state_dict` / :func:`checkpoint.load_state_dict`
    (loading writes into ``local`` in place) and for plain DCP. Computed
    locally, no communication.
    """
    if offsets is None and flat_start is None:
        offsets = (0,) * len(tuple(global_shape))
    if flat_start is not None and not local.is_contiguous():
        raise ValueError("shard(flat_start=...) needs a contiguous local tensor (its flat order is the global one)")
    spec = ShardSpec(tuple(global_shape), offsets=offsets, flat_start=flat_start)
    return CheckpointShard(local, spec, max_chunk_bytes=max_chunk_bytes)
