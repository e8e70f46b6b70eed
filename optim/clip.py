"""Gradient-norm clipping on local shards, with one reduction per process group: torch's bits.

``torch.nn.utils.clip_grad_norm_`` on DTensor gradients issues collectives
through DTensor dispatch, cannot see gradients in ``decoupled_grad`` and knows
nothing of flat-shard parameters. :func:`clip_grad_norm_` works on what each
rank holds and gives torch's result bit for bit where torch has one:

* **plain** tensors without a shard spec are whole tensors: their norm is
  ``torch.nn.utils.get_total_norm``'s (per-tensor norms in the grads' own dtype, a
  bf16 norm of bf16 grads as torch computes it, then the norm of their stack), not reduced;
* a **DTensor** gradient contributes its local tensor; the local norm of all DTensors
  sharded on one mesh dim (FSDP2; HSDP's shard dim) is reduced over that dim's group
  as DTensor reduces a partial norm (x^p, one ``all_reduce`` SUM, ^(1/p); MAX for the
  inf-norm), so the norm and the clipped grads equal torch's clip on the same DTensors;
  replicas (``Replicate`` dims) each compute the same value;
* a **flat-shard / box** parameter (one with a :class:`~offload_fsdp.shard_spec.ShardSpec`)
  contributes its local gradient, reduced the same way over ``mesh_or_group`` (default: the
  world), again with one ``all_reduce`` for all of them;
* several of these kinds in one call: their norms are combined as torch combines
  per-tensor norms (``vector_norm`` of their stack): the same norm, torch has no bits for it;
* gradients are read with :func:`~offload_fsdp.grad.get_grad`, so ``decoupled_grad``
  is honoured; they may sit on different devices (host and accelerator), grouped per
  (device, dtype) as torch groups them.

Preconditions: every rank passes the same parameters in the same order, each
with or without a gradient on all ranks alike (the collectives must match).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from offload_fsdp.grad import get_grad, local_tensor
from offload_fsdp.overlap import refuse_overlapped
from offload_fsdp.shard_spec import shard_spec_of
from offload_fsdp.speculative import clip_notes

__all__ = ["clip_grad_norm_", "grad_norm"]

_LOCAL = "local"


@dataclass
class _Reduction:
    """The local gradient tensors whose norm is reduced over one process group (or kept local)."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    """local grads whose norm this rank contributes"""
    dtensor_only: bool = True
    """every tensor is a DTensor's local shard: torch's clip takes per-tensor norms there (foreach=None)"""


@dataclass
class _Buckets:
    """Local gradient tensors sorted by where their partial norm must be reduced."""

    counted: dict[object, _Reduction] = field(default_factory=lambda: defaultdict(_Reduction))
    """reduction key (``_LOCAL`` or a process group) -> the local grads whose norm this rank contributes"""
    all_grads: list[torch.Tensor] = field(default_factory=list)
    """every local grad tensor, counted or not: all of them are scaled when clipping"""

    def count(self, key: object, local: torch.Tensor, *, dtensor: bool, replica: bool = False) -> None:
        """Add ``local`` to ``key``'s reduction; a ``replica`` of what another rank counts adds a norm of 0
        (an empty tensor of its dtype: every rank's stack of norms stays as long, in the same order)."""
        reduction = self.counted[key]
        reduction.tensors.append(local.new_empty(0) if replica else local)
        reduction.dtensor_only &= dtensor


def _group_of_mesh(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """A process group spanning every rank of ``mesh`` (None = the default group)."""
    if mesh.size() == dist.get_world_size():
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    # A multi-dim sub-mesh of the world: its flattened 1-D view has a group over all of its ranks.
    return mesh._flatten().get_group()


def _check_not_partial(placements: tuple, name: str) -> None:
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise ValueError(
                f"{name}: gradient is Partial on mesh dim {dim}; reduce it (e.g. redistribute to Shard/Replicate) "
                "before clipping, a norm of unreduced partial sums is meaningless"
            )


def _dtensor_key(mesh: DeviceMesh, placements: tuple, name: str) -> tuple[object, bool]:
    """Where a DTensor grad's local norm is reduced, as torch's DTensor clip reduces it, and whether this
    rank is a replica that must not count it.

    torch's norm of a DTensor is partial along its ``Shard`` mesh dims and is reduced over those
    dims' groups only (a replica holds the same value): with one such dim (FSDP2, HSDP), every rank
    counts its local shard and reduces over that dim's group, which gives torch's bits. With several
    (FSDP + TP), one ``all_reduce`` over the whole mesh, the replica at coordinate 0 of each
    ``Replicate`` dim counting: the same norm, not necessarily torch's last bit.
    """
    _check_not_partial(placements, name)
    sharded = [dim for dim, placement in enumerate(placements) if isinstance(placement, Shard)]
    if not sharded:
        return _LOCAL, False  # replicated on every dim: every rank holds the whole norm
    if len(sharded) == 1:
        dim = sharded[0]
        return (None if mesh.size(dim) == dist.get_world_size() else mesh.get_group(dim)), False
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # the caller checked that this rank is in the mesh
    replica = any(isinstance(p, Replicate) and coordinate[d] != 0 for d, p in enumerate(placements))
    return _group_of_mesh(mesh), replica


def _resolve_flat_group(mesh_or_group: DeviceMesh | dist.ProcessGroup | None) -> object:
    if mesh_or_group is None:
        return None if dist.is_available() and dist.is_initialized() else _LOCAL
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(
                f"mesh_or_group is a {mesh_or_group.ndim}-D mesh; flat-shard params are sharded over one dim: "
                "pass that dim's sub-mesh (e.g. mesh['dp_shard']) or its process group"
            )
        return _group_of_mesh(mesh_or_group)
    return mesh_or_group


def _bucket(params: list[torch.Tensor], mesh_or_group: DeviceMesh | dist.ProcessGroup | None) -> _Buckets:
    buckets = _Buckets()
    flat_group: object | None = ...  # resolved on first use only: no dist calls for plain params
    for index, param in enumerate(params):
        grad = get_grad(param)
        if grad is None:
            continue
        name = f"parameter {index} (shape {tuple(param.shape)})"
        source = grad if isinstance(grad, DTensor) else param
        local = local_tensor(grad)
        if grad.is_sparse:
            raise TypeError(f"{name}: sparse gradients are not supported by clip_grad_norm_")
        buckets.all_grads.append(local)
        if isinstance(source, DTensor):
            # A plain (decoupled) gradient of a DTensor param is that param's local shard.
            if source.device_mesh.get_coordinate() is None:
                continue  # this rank is not part of the mesh: it holds nothing of the tensor
            key, replica = _dtensor_key(source.device_mesh, tuple(source.placements), name)
            buckets.count(key, local, dtensor=True, replica=replica)
        elif shard_spec_of(param) is not None or shard_spec_of(grad) is not None:
            if flat_group is ...:
                flat_group = _resolve_flat_group(mesh_or_group)
            buckets.count(flat_group, local, dtensor=False)
        else:
            buckets.count(_LOCAL, local, dtensor=False)
    return buckets


def _tensor_norms(reduction: _Reduction, norm_type: float, foreach: bool | None) -> torch.Tensor:
    """This rank's per-tensor norms, stacked, exactly as torch's ``get_total_norm`` takes them before their norm.

    torch groups the tensors by (device, dtype), takes each group's norms in its dtype (a bf16 norm
    of bf16 grads) with one foreach kernel where it has one (never for DTensors unless ``foreach=True``),
    and stacks them in that order on the first tensor's device (promoted to a common dtype).
    """
    tensors = reduction.tensors
    if math.isinf(norm_type):
        # A max is exact in any order and grouping. torch's inf-norm of an empty tensor raises; an
        # empty shard adds nothing to a max: a zero in its place keeps every rank's stack as long.
        return torch.stack([_inf_norm(t).to(tensors[0].device) for t in tensors])
    if reduction.dtensor_only:
        foreach = bool(foreach)  # torch's clip has no foreach support for DTensors unless asked for
    # Private: torch's own grouping, so that the norms are stacked in the order torch stacks them (the
    # order changes the last bit of their norm); renamed -> test_torch_private_uses fails first.
    grouped = _group_tensors_by_device_and_dtype([tensors])  # type: ignore[list-item]
    norms: list[torch.Tensor] = []
    for (device, _), ([group], _) in grouped.items():
        norms.extend(_group_norms([t for t in group if t is not None], device, norm_type, foreach))
    return torch.stack([n.to(tensors[0].device) for n in norms])


def _inf_norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, math.inf) if t.numel() else torch.zeros((), dtype=t.dtype, device=t.device)


def _group_norms(
    group: list[torch.Tensor], device: torch.device, norm_type: float, foreach: bool | None
) -> list[torch.Tensor]:
    """Per-tensor norms of one (device, dtype) group, as torch takes them; a backend that claims foreach
    support without a foreach norm kernel (some PrivateUse1 ones) goes per tensor unless ``foreach=True``."""
    if foreach or (foreach is None and _has_foreach_support(group, device)):
        try:
            return list(torch._foreach_norm(group, norm_type))
        except (NotImplementedError, RuntimeError):
            if foreach:  # asked for explicitly: the backend's error stands
                raise
    return [torch.linalg.vector_norm(t, norm_type) for t in group]


def _reduce_device(group: object) -> torch.device:
    """Where ``group``'s all_reduce runs: the current accelerator when the group has a non-gloo backend
    for it (nccl, xccl, hccl, a PrivateUse1 one), else the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return torch.device("cpu")
    config = dist.get_backend_config(group)  # type: ignore[arg-type]  # e.g. "cpu:gloo,cuda:nccl"
    backends = dict(entry.split(":", 1) for entry in config.split(",") if ":" in entry)
    if backends.get(accelerator.type, "gloo") == "gloo":
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)) or norm_type == -math.inf:
        raise ValueError(f"norm_type={norm_type} is not supported; use a p > 0 or float('inf')")
    return norm_type


def _reduced_norms(norms: torch.Tensor, group: object, norm_type: float) -> torch.Tensor:
    """Each tensor's norm over ``group`` from each rank's norms of its shards, as DTensor makes a stack of
    partial norms whole before taking their norm (``_NormPartial``: x^p, one all_reduce SUM, ^(1/p);
    the inf-norm: all_reduce MAX)."""
    part = norms.to(_reduce_device(group))
    if math.isinf(norm_type):
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        return part
    part = part**norm_type
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    return part ** (1.0 / norm_type)


def _total_norm(buckets: _Buckets, norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The global norm of the bucketed gradients: one ``all_reduce`` per process group among them.

    One kind of gradient gives torch's bits: plain tensors ``torch.nn.utils.get_total_norm``'s,
    FSDP2 DTensors those of torch's clip on the DTensors. Several kinds are combined as torch combines
    per-tensor norms (``vector_norm`` of their stack).
    """
    if not buckets.all_grads:
        return torch.tensor(0.0)  # torch's norm of no gradients
    result_device = buckets.all_grads[0].device  # torch's: the first gradient's
    parts = []
    # Insertion order follows the parameter order, the same on every rank.
    for key, reduction in buckets.counted.items():
        norms = _tensor_norms(reduction, norm_type, foreach)
        if key != _LOCAL:
            norms = _reduced_norms(norms, key, norm_type)
        parts.append(torch.linalg.vector_norm(norms.to(result_device), norm_type))
    if len(parts) == 1:
        return parts[0]
    return torch.linalg.vector_norm(torch.stack(parts), norm_type)


def grad_norm(
    params: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    mesh_or_group: DeviceMesh | dist.ProcessGroup | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The global gradient norm of ``params`` from local shards (see the module doc); no gradient is changed.

    Collective: one ``all_reduce`` per distinct process group among the
    gradients (typically one). Returns what ``torch.nn.utils.get_total_norm`` returns
    for the same gradients: a 0-d tensor in their (promoted) dtype, so bf16 for bf16
    grads, on the first gradient's device.
    """
    norm_type = _check_norm_type(norm_type)
    params = [params] if torch.is_tensor(params) else list(params)
    refuse_overlapped(params, "optim.grad_norm")  # their update may have run before the norm is known
    return _total_norm(_bucket(params, mesh_or_group), norm_type, foreach)


def clip_grad_norm_(
    params: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    mesh_or_group: DeviceMesh | dist.ProcessGroup | None = None,
    foreach: bool | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale every local gradient so the global norm is at most ``max_norm``; returns the norm before clipping.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` (coefficient
    ``max_norm / (norm + 1e-6)`` clamped to 1; a non-finite norm raises
    ``RuntimeError`` with ``error_if_nonfinite=True``, else propagates into the
    gradients as torch does), computed on local shards as described in the
    module doc. Collective: as :func:`grad_norm`. Side effect: gradients
    (``grad`` or ``decoupled_grad``) are scaled in place, their storage is kept.
    """
    norm_type = _check_norm_type(norm_type)
    params = [params] if torch.is_tensor(params) else list(params)
    # Their update may have run before the norm is known: refused, or redone unless the coefficient is 1.
    refuse_overlapped(params, "optim.clip_grad_norm_")
    speculating = clip_notes(params)
    buckets = _bucket(params, mesh_or_group)  # the gradients are collected once, for the norm and the scaling
    total = _total_norm(buckets, norm_type, foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it "
            "cannot be clipped; pass error_if_nonfinite=False to scale the gradients by the non-finite factor"
        )
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in buckets.all_grads:
        by_device[t.device].append(t)
    for device, group in by_device.items():
        scale = coefficient.to(device)
        if foreach is False:
            for t in group:
                t.mul_(scale)
        else:
            # not nn.utils.clip_grads_with_norm_: it scales `p.grad` only, not decoupled grads or local
            # shards of DTensor grads; renamed -> clip_grad_norm_ raises
            torch._foreach_mul_(group, scale)
    for speculation, theirs, keys_before in speculating:
        speculation.note_clip(theirs, keys_before, coefficient)
    return total
