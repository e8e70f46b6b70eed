"""Gradient-norm clipping on local shards, with one reduction per process group.

``torch.nn.utils.clip_grad_norm_`` on DTensor gradients issues collectives
through DTensor dispatch, cannot see gradients in ``decoupled_grad`` and knows
nothing of flat-shard parameters. :func:`clip_grad_norm_` works on what each
rank holds:

* a **DTensor** gradient contributes its local tensor; the partial norms of all
  DTensors on one mesh are reduced with a single ``all_reduce`` over that mesh.
  Along ``Replicate`` mesh dims (HSDP) only the replica at coordinate 0
  contributes, so identical replicas are not counted twice;
* a **flat-shard / box** parameter (one with a :class:`~offload_fsdp.shard_spec.ShardSpec`)
  contributes its local gradient, reduced over ``mesh_or_group`` (default: the
  world), again with one ``all_reduce`` for all of them;
* a **plain** tensor without a shard spec is a whole tensor: it is counted
  locally and not reduced (every rank holds the same copy);
* gradients are read with :func:`~offload_fsdp.grad.get_grad`, so ``decoupled_grad``
  is honoured; they may sit on different devices (host and accelerator): norms
  are computed per (device, dtype) group with one foreach kernel and summed.

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
from torch.distributed.tensor.placement_types import Partial, Replicate

from offload_fsdp.grad import get_grad, local_tensor
from offload_fsdp.overlap import refuse_overlapped
from offload_fsdp.shard_spec import shard_spec_of
from offload_fsdp.speculative import clip_notes

__all__ = ["clip_grad_norm_", "grad_norm"]

_LOCAL = "local"


@dataclass
class _Buckets:
    """Local gradient tensors sorted by where their partial norm must be reduced."""

    counted: dict[object, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    """reduction key (``_LOCAL`` or a process group) -> local grads whose norm this rank contributes"""
    all_grads: list[torch.Tensor] = field(default_factory=list)
    """every local grad tensor, counted or not: all of them are scaled when clipping"""


def _group_of_mesh(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """A process group spanning every rank of ``mesh`` (None = the default group)."""
    if mesh.size() == dist.get_world_size():
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    # A multi-dim sub-mesh of the world: its flattened 1-D view has a group over all of its ranks.
    return mesh._flatten().get_group()


def _counts_on_this_rank(mesh: DeviceMesh, placements: tuple, name: str) -> bool:
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the mesh: it holds nothing of the tensor
        return False
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise ValueError(
                f"{name}: gradient is Partial on mesh dim {dim}; reduce it (e.g. redistribute to Shard/Replicate) "
                "before clipping, a norm of unreduced partial sums is meaningless"
            )
        # Replicas along a Replicate dim hold identical data: count the one at coordinate 0 only.
        if isinstance(placement, Replicate) and coordinate[dim] != 0:
            return False
    return True


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
            # The key is registered even when this rank does not count: every rank must see the
            # same groups in the same order, or the all_reduces below would pair up wrongly.
            counted = buckets.counted[_group_of_mesh(source.device_mesh)]
            if _counts_on_this_rank(source.device_mesh, tuple(source.placements), name):
                counted.append(local)
        elif shard_spec_of(param) is not None or shard_spec_of(grad) is not None:
            if flat_group is ...:
                flat_group = _resolve_flat_group(mesh_or_group)
            buckets.counted[flat_group].append(local)
        else:
            buckets.counted[_LOCAL].append(local)
    return buckets


def _accumulate_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _partial_norm(
    tensors: list[torch.Tensor],
    norm_type: float,
    acc_dtype: torch.dtype,
    out_device: torch.device,
    foreach: bool | None,
) -> torch.Tensor:
    """Sum of |x|^p (or max |x| for inf) over ``tensors``, as a 0-d ``acc_dtype`` tensor on ``out_device``."""
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        # Empty shards are skipped: the inf-norm of an empty tensor is undefined in torch.
        if t.numel():
            by_device[(t.device, t.dtype)].append(t)
    partials = [torch.zeros((), dtype=acc_dtype, device=out_device)]
    for group in by_device.values():
        stacked = torch.stack(_norms(group, norm_type, acc_dtype, foreach))
        part = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()
        # One small device->host (or cross-device) move per device, not per tensor.
        partials.append(part.to(out_device))
    combined = torch.stack(partials)
    return combined.max() if math.isinf(norm_type) else combined.sum()


def _norms(
    group: list[torch.Tensor], norm_type: float, acc_dtype: torch.dtype, foreach: bool | None
) -> list[torch.Tensor]:
    """Per-tensor norms of one (device, dtype) group: one foreach kernel where the backend has it."""
    if foreach is not False:
        try:
            # not nn.utils.get_total_norm: it returns a finished norm, and the cross-rank sum needs the
            # per-tensor norms (re-powering a norm is not bit-identical); renamed -> clip_grad_norm_ raises
            return list(torch._foreach_norm(group, norm_type, dtype=acc_dtype))
        except (NotImplementedError, RuntimeError):
            if foreach:  # asked for explicitly: the backend's error stands
                raise
            # default: a backend without a foreach norm kernel (some PrivateUse1 ones) goes per tensor
    return [torch.linalg.vector_norm(t, norm_type, dtype=acc_dtype) for t in group]


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


def _total_norm(buckets: _Buckets, norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The global norm of the bucketed gradients: one ``all_reduce`` per process group among them."""
    acc_dtype = _accumulate_dtype(buckets.all_grads)
    result_device = next((t.device for t in buckets.all_grads if t.device.type != "cpu"), torch.device("cpu"))
    is_inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=acc_dtype, device=result_device)
    # Insertion order follows the parameter order, the same on every rank.
    for key, tensors in buckets.counted.items():
        if key == _LOCAL:
            part = _partial_norm(tensors, norm_type, acc_dtype, result_device, foreach)
        else:
            part = _partial_norm(tensors, norm_type, acc_dtype, _reduce_device(key), foreach)
            dist.all_reduce(part, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=key)
            part = part.to(result_device)
        total = torch.maximum(total, part) if is_inf else total + part
    return total if is_inf else total.pow(1.0 / norm_type)


def grad_norm(
    params: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    mesh_or_group: DeviceMesh | dist.ProcessGroup | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The global gradient norm of ``params`` from local shards (see the module doc); no gradient is changed.

    Collective: one ``all_reduce`` per distinct process group among the
    gradients (typically one). Returns a 0-d fp32 (fp64 for fp64 grads) tensor
    on the CPU, or on the device of the first non-CPU gradient.
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
