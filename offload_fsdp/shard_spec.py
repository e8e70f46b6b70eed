"""How a rank's local tensor sits inside its global tensor, without communication.

A :class:`ShardSpec` is the one description of a local shard that the whole
toolkit shares: the optimizer reads it to know a flat-shard parameter is a
shard, and the checkpoint layer turns it into DCP chunk metadata. It is either

* a **box**: the local tensor has the global tensor's rank and sits at
  ``offsets`` (row blocks of FSDP2 are boxes), or
* a **flat range**: the local tensor holds elements ``[flat_start, flat_start + numel)``
  of the global tensor's row-major order (flat-buffer FSDP, ZeRO, Megatron-FSDP).

Flat-shard parameters carry their spec as the attribute ``fsdp_shard_spec``
(see :func:`attach_shard_spec`). Megatron-FSDP's convention, a
``megatron_fsdp_slice`` attribute holding a ``slice`` of the flattened global
parameter, is read too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SHARD_SPEC_ATTR", "ShardSpec", "attach_shard_spec", "shard_spec_of"]

SHARD_SPEC_ATTR = "fsdp_shard_spec"
MEGATRON_SLICE_ATTR = "megatron_fsdp_slice"


@dataclass(frozen=True)
class ShardSpec:
    """A local shard's place in its global tensor: a box at ``offsets`` or a flat range at ``flat_start``."""

    global_shape: tuple[int, ...]
    """the true (unflattened) shape of the global tensor"""
    offsets: tuple[int, ...] | None = None
    """box form: the local tensor's offset in each dim of the global tensor"""
    flat_start: int | None = None
    """flat-range form: index of the local tensor's first element in the global row-major order"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        if (self.offsets is None) == (self.flat_start is None):
            raise ValueError("ShardSpec needs exactly one of offsets= (a box) or flat_start= (a flat range)")
        if any(s < 0 for s in self.global_shape):
            raise ValueError(f"ShardSpec.global_shape {self.global_shape} has a negative size")
        if self.offsets is not None:
            object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
            if len(self.offsets) != len(self.global_shape):
                raise ValueError(
                    f"ShardSpec.offsets {self.offsets} has {len(self.offsets)} dims but the global "
                    f"shape {self.global_shape} has {len(self.global_shape)}"
                )
        elif self.flat_start is not None and not 0 <= self.flat_start <= self.global_numel:
            raise ValueError(
                f"ShardSpec.flat_start={self.flat_start} is outside the global tensor of "
                f"{self.global_numel} elements (shape {self.global_shape})"
            )

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def is_flat(self) -> bool:
        return self.flat_start is not None

    def check_local(self, local: torch.Tensor, *, name: str = "tensor") -> None:
        """Raise ``ValueError`` naming ``name`` if ``local`` cannot be this shard."""
        if self.flat_start is not None:
            if self.flat_start + local.numel() > self.global_numel:
                raise ValueError(
                    f"{name}: flat range [{self.flat_start}, {self.flat_start + local.numel()}) runs past "
                    f"the global tensor of {self.global_numel} elements (shape {self.global_shape})"
                )
            return
        if local.dim() != len(self.global_shape):
            raise ValueError(
                f"{name}: a box shard must have the global rank {len(self.global_shape)}, "
                f"got local shape {tuple(local.shape)}"
            )
        assert self.offsets is not None  # __post_init__: exactly one of offsets / flat_start
        for dim, (off, size, full) in enumerate(zip(self.offsets, local.shape, self.global_shape)):
            if off < 0 or off + size > full:
                raise ValueError(
                    f"{name}: box at offsets {self.offsets} with local shape {tuple(local.shape)} "
                    f"leaves the global shape {self.global_shape} in dim {dim}"
                )


def attach_shard_spec(param: torch.Tensor, spec: ShardSpec, *, name: str = "parameter") -> torch.Tensor:
    """Mark ``param`` (holding only its local data) as a shard of a larger tensor; returns ``param``."""
    spec.check_local(param, name=name)
    setattr(param, SHARD_SPEC_ATTR, spec)
    return param


def shard_spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    """The flat-shard / box description carried by ``tensor``, or None for a whole tensor or a DTensor.

    Reads ``fsdp_shard_spec`` first, then Megatron-FSDP's ``megatron_fsdp_slice``
    (global shape from ``orig_param`` if present, else the DTensor's global shape).
    Raises ``TypeError`` for a strided slice and ``ValueError`` for one whose length
    is not the tensor's element count.
    """
    spec = getattr(tensor, SHARD_SPEC_ATTR, None)
    if spec is not None:
        return spec
    megatron_slice = getattr(tensor, MEGATRON_SLICE_ATTR, None)
    if megatron_slice is None:
        return None
    if not isinstance(megatron_slice, slice) or megatron_slice.step not in (None, 1):
        raise TypeError(
            f"{MEGATRON_SLICE_ATTR} must be a contiguous slice of the flattened parameter, got {megatron_slice!r}"
        )
    start = int(megatron_slice.start or 0)
    if megatron_slice.stop is not None and megatron_slice.stop - start != tensor.numel():
        raise ValueError(
            f"{MEGATRON_SLICE_ATTR} {megatron_slice} covers {megatron_slice.stop - start} elements but the "
            f"local shard has {tensor.numel()}; the slice must describe exactly the local data"
        )
    orig = getattr(tensor, "orig_param", None)
    global_shape = tuple(orig.shape) if orig is not None else tuple(tensor.shape)
    return ShardSpec(global_shape=global_shape, flat_start=start)
