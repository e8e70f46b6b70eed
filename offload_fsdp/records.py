"""One record per parameter shard, and the deterministic host/device partition.

A :class:`ParamShard` is everything the optimizer knows about one parameter's
*local* shard: the parameter, its name, where its update runs, its slices of
the host buckets, the tensor a delegated optimizer updates, and its public
optimizer state. There are no side maps keyed by parameter: code that needs a
fact about a parameter reads it from the record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Partial

from offload_fsdp.grad import local_tensor
from offload_fsdp.shard_spec import shard_spec_of

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket
    from offload_fsdp.state_only import ParkedBucket

__all__ = ["ParamShard", "bit_views", "build_records", "grad_key", "param_name", "partition"]


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Same-sized tensors' bytes as the widest integers they all align to (int64 where every one's byte
    offset and size allow, else their element's width): equal views mean equal bits, and torch.equal
    costs per element (over uint8 views ~5x as much on a CPU as over int32, int64 another ~1.3x less)."""
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    if all(f.numel() % 8 == 0 and f.storage_offset() % 8 == 0 for f in flat):
        return [f.view(torch.int64) for f in flat]
    return [t.reshape(-1).view(_SAME_WIDTH_INT.get(t.element_size(), torch.uint8)) for t in tensors]


def grad_key(grad: torch.Tensor) -> tuple[int, int, int]:
    """(id, data_ptr, version counter) of a local grad: a different key means another or an edited grad.

    Accumulation (the next micro-batch) and in-place edits through the tensor (clipping) bump the
    version counter; a new tensor has a new id. An equal key does not prove the bits unchanged:
    writes below autograd (``grad.data.mul_``, ``dist.all_reduce(grad)``, GradScaler's unscale,
    ``_foreach_*`` ops on a DTensor's local shard) move no counter, so a host copy is trusted
    only after a comparison of its bits (``overlap``) or copied again (``Transfer.stage_grads``).
    """
    return (id(grad), grad.data_ptr(), grad._version)


@dataclass(eq=False, kw_only=True)
class ParamShard:
    """Everything about one parameter's local shard (identity-compared; one per parameter)."""

    param: torch.Tensor
    """the parameter as the user gave it (a plain tensor, a DTensor, or a flat-shard tensor)"""
    name: str
    """fully-qualified name when known (named params), else its position ``param_groups[g][i]``"""
    group_index: int
    """index of its group in ``optimizer.param_groups`` (hyper-parameters are read from there)"""
    trainable: bool = True
    """``requires_grad`` at construction: only these get update space (a param unfrozen later
    is refused at ``step()`` with the fix, never half-served)"""
    offloaded: bool = False
    """True when its update runs on the host (fp32 master + state in host buckets)"""
    grad_dtype: torch.dtype | None = None
    """dtype gradients are staged in on the host (offloaded only): the grad's own dtype"""

    # --- host side (offloaded records) ---
    bucket: HostBucket | None = None
    offset: int = 0
    """first element of this shard in its bucket's flat buffers"""
    master: torch.Tensor | None = None
    """host copy the update is applied to (fp32 master, or the param dtype without fp32 update)"""
    param_stage: torch.Tensor | None = None
    """host buffer in the param's dtype that H2D copies from, when it differs from ``master``"""
    grad_stage: torch.Tensor | None = None
    """host buffer the gradient is copied into (its own dtype)"""
    staged_grad_key: tuple[int, int, int] | None = None
    """(id, data_ptr, version) of the device grad last copied into ``grad_stage`` this step"""
    upcast_key: tuple[int, int, int, int] | None = None
    """``synced_key`` taken when the master was exactly the param's values widened (copied from the param, or
    refreshed from it while it was): see :attr:`master_is_upcast`"""
    synced_key: tuple[int, int, int, int] | None = None
    """(id, data_ptr, version, the DTensor's version) of the local param when the optimizer last made it and its
    master agree (records with a separate master only): a different key means the user
    wrote the param since, so its master must be refreshed before the next update"""

    parked: ParkedBucket | None = None
    """``offload_state_only`` device-share records only: the bucket whose device optimizer updates it and
    whose host buffers hold its master and state between steps (:mod:`offload_fsdp.state_only`)"""

    # --- delegated optimizers (device share, and host buckets without a fused kernel) ---
    working: torch.Tensor | None = None
    """the plain tensor the update is applied to, set for every trainable record: the host
    ``master`` when offloaded, else the local param or its device fp32 master"""

    # --- public optimizer state ---
    state: dict[str, Any] | None = None
    """the dict exposed as ``optimizer.state[param]`` once state exists (None before)"""
    inner_state: dict[str, Any] | None = field(default=None, repr=False)
    """the delegated optimizer's own state dict for ``working`` (delegated records only)"""
    placeholder_state: bool = False
    """state made by ``materialize_state`` (or, in a host-kernel bucket, at a first step) and not loaded
    or updated since: its next update lets the class create its first-step state itself, as in torch.
    Delegated records: same values for torch's classes (:mod:`offload_fsdp.fresh_state`); for another
    class the materialised state is zero-filled. Host kernels: zeros, which SGD's first update replaces
    by the grad (:mod:`offload_fsdp.sgd_step`)"""

    # Views of the optional fields above for code that runs only where they are set
    # (an AssertionError names the record otherwise: an internal invariant, not a user error).

    @property
    def working_tensor(self) -> torch.Tensor:
        """``working``, for trainable records (always set there)."""
        assert self.working is not None, f"{self.name}: no working tensor (a frozen parameter)"
        return self.working

    @property
    def host_bucket(self) -> HostBucket:
        """``bucket``, for offloaded records (always set there)."""
        assert self.bucket is not None, f"{self.name}: no host bucket (not offloaded)"
        return self.bucket

    @property
    def host_master(self) -> torch.Tensor:
        """``master``, for offloaded records (always set there)."""
        assert self.master is not None, f"{self.name}: no host master (not offloaded)"
        return self.master

    @property
    def host_grad_stage(self) -> torch.Tensor:
        """``grad_stage``, for offloaded records (always set there)."""
        assert self.grad_stage is not None, f"{self.name}: no host grad staging (not offloaded)"
        return self.grad_stage

    @property
    def created_state(self) -> dict[str, Any]:
        """``state``, for code that runs after it was created (materialised or stepped)."""
        assert self.state is not None, f"{self.name}: optimizer state used before it was created"
        return self.state

    @property
    def local(self) -> torch.Tensor:
        """The rank-local data (re-read each time: FSDP may swap the DTensor's local tensor)."""
        return local_tensor(self.param)

    @property
    def numel(self) -> int:
        return self.local.numel()

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The whole parameter's shape: the DTensor's, a flat shard's spec's, else the local shape."""
        if self.is_dtensor:
            return tuple(self.param.shape)
        spec = shard_spec_of(self.param)
        return spec.global_shape if spec is not None else tuple(self.local.shape)

    @property
    def is_sharded(self) -> bool:
        """True when the local tensor is only a piece of the parameter (a replica is not)."""
        return tuple(self.local.shape) != self.global_shape

    @property
    def is_dtensor(self) -> bool:
        return isinstance(self.param, DTensor)

    def staging_holds(self, grad: torch.Tensor) -> bool:
        """True when the host grad staging holds, bit for bit, the local ``grad`` as it is now.

        The one exact check of a host copy: a :func:`grad_key` cannot see writes below autograd.
        A host grad is compared in place; a device grad is read back once (one D2H of it, the
        volume its staging copy moved) and compared.
        """
        stage = self.host_grad_stage
        if grad.device != stage.device:
            now = torch.empty_like(stage)
            self.host_bucket.engine.fetch(now, grad)
            grad = now
        return torch.equal(*bit_views(grad, stage))  # bit for bit: a NaN equals itself here

    @property
    def push_source(self) -> torch.Tensor:
        """The host tensor holding the updated param in its own dtype (what H2D copies)."""
        return self.param_stage if self.param_stage is not None else self.host_master

    @property
    def has_master(self) -> bool:
        """True when the update is applied to a copy of the param (host master, or a device fp32 master)."""
        return self.working is not None and self.working is not self.local

    def _local_key(self) -> tuple[int, int, int, int]:
        # Both counters: a write through the DTensor (``model.load_state_dict``, ``p.mul_``) bumps
        # the DTensor's only; one into ``to_local()`` bumps the local tensor's only.
        local = self.local
        return (id(local), local.data_ptr(), local._version, self.param._version)

    def mark_synced(self, *, master_is_upcast: bool = False) -> None:
        """Record the local param's identity and version counter after master and param were made to agree.

        ``master_is_upcast``: the master is exactly the param widened (it was copied from it).
        """
        self.synced_key = self._local_key()
        if master_is_upcast:
            self.upcast_key = self.synced_key

    @property
    def master_is_upcast(self) -> bool:
        """True when the master is exactly the param's values widened: a checkpoint need not store it.

        Every update or load writes the param afterwards (H2D of the new cast) and calls
        :meth:`mark_synced`, whose new version key then differs from ``upcast_key``; so no
        update path has to clear anything, and deciding costs no copy or comparison.
        """
        return self.upcast_key is not None and self.upcast_key == self.synced_key

    @property
    def written_since_sync(self) -> bool:
        """True when the local param was written in place (or replaced) since :meth:`mark_synced`.

        Every in-place op bumps a tensor's version counter (``copy_``, ``mul_``,
        ``load_state_dict``'s copy, an EMA swap), so this costs no pass over the data.
        """
        return self.synced_key != self._local_key()

    @property
    def has_separate_master(self) -> bool:
        """True when a master of higher precision than the param exists (stored as ``offload_fsdp.master.MASTER_KEY``)."""
        return self.working is not None and self.working.dtype != self.param.dtype

    def wrap(self, tensor: torch.Tensor) -> torch.Tensor:
        """Present a local state tensor like the param: a DTensor with its mesh/placements, else as is.

        Only tensors shaped like the local shard are wrapped; scalars (``step``) stay plain,
        as in torch's own optimizers over DTensor params.
        """
        param = self.param
        if not isinstance(param, DTensor) or tensor.shape != self.local.shape:
            return tensor
        return DTensor.from_local(
            _own_storage(tensor), param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as ``tensor`` (a view into a host buffer), as a tensor at storage offset 0.

    torch.save / copy.deepcopy of a DTensor whose local tensor has a non-zero storage
    offset fails ("Attempted to access the data pointer on an invalid python storage":
    the wrapper's data_ptr is then non-zero, so torch pickles its empty storage). A slice
    of the untyped storage shares the memory (and keeps the buffer alive), so in-place
    loads into these tensors still land in the optimizer's buffers.
    """
    if tensor.storage_offset() == 0:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()[start : start + tensor.numel() * tensor.element_size()]
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, tensor.shape, tensor.stride())


def param_name(group: dict[str, Any], group_index: int, position: int) -> str:
    """FQN from the group's ``param_names`` when given, else the position ``param_groups[g]['params'][i]``."""
    names = group.get("param_names")
    if names is not None and position < len(names):
        return str(names[position])
    return f"param_groups[{group_index}]['params'][{position}]"


def _validate(param: torch.Tensor, name: str) -> None:
    """Reject parameters this optimizer cannot serve, naming them (a flat-shard spec must fit the tensor)."""
    if param.device.type == "meta":
        raise ValueError(
            f"parameter {name!r} is on the meta device; materialize the model (e.g. to_empty + init) "
            "before building HybridDeviceOptimizer"
        )
    if param.layout != torch.strided:
        raise TypeError(f"parameter {name!r} has layout {param.layout}; only dense (strided) parameters are supported")
    if not param.is_floating_point():
        raise TypeError(f"parameter {name!r} has dtype {param.dtype}; only floating point parameters can be optimized")
    if isinstance(param, DTensor):
        if any(isinstance(p, Partial) for p in param.placements):
            raise ValueError(
                f"parameter {name!r} is a DTensor with a Partial placement {param.placements}; "
                "only Shard/Replicate parameters have a well-defined local shard to update"
            )
        if not local_tensor(param).is_contiguous():
            raise ValueError(f"parameter {name!r}: its local shard is not contiguous; cannot stage it in flat buffers")
        return
    if not param.is_contiguous():
        raise ValueError(f"parameter {name!r} is not contiguous; make it contiguous before building the optimizer")
    try:
        spec = shard_spec_of(param)
    except (TypeError, ValueError) as exc:  # a malformed megatron_fsdp_slice: say which parameter carries it
        raise type(exc)(f"parameter {name!r}: {exc}") from exc
    if spec is not None:
        spec.check_local(param, name=name)


def build_records(groups: list[dict[str, Any]], *, first_group_index: int = 0) -> list[ParamShard]:
    """One validated record per parameter of ``groups``, in order (the state-dict id order).

    ``groups[0]`` is ``param_groups[first_group_index]`` (non-zero for a group added
    after construction). Raises, naming the parameter, before returning any record.
    """
    records: list[ParamShard] = []
    for group_index, group in enumerate(groups, start=first_group_index):
        for position, param in enumerate(group["params"]):
            name = param_name(group, group_index, position)
            _validate(param, name)
            records.append(ParamShard(param=param, name=name, group_index=group_index, trainable=param.requires_grad))
    return records


def partition(records: list[ParamShard], offload_fraction: float, *, host_resident_is_offloaded: bool) -> None:
    """Mark a prefix (in parameter order) of the trainable records as offloaded; deterministic.

    Whole parameters move; a parameter goes to the host when the midpoint of its
    element range lies within the first ``offload_fraction`` of all candidate
    local elements, so the host share is the closest whole-parameter prefix to
    the requested fraction. 0 offloads nothing, 1 everything (empty shards
    included). Frozen parameters are never offloaded (they are never updated).

    With ``host_resident_is_offloaded`` (an accelerator holds some params), params
    already on the CPU always take the host path and the fraction counts
    device-resident elements only. Without an accelerator every param is on the
    CPU and the fraction counts them all. Each rank partitions its own local
    shard independently: no communication. Called once with all records at
    construction, and once with each group's records when a group is added later
    (the fraction then applies within that group).
    """
    trainable = [r for r in records if r.trainable]
    candidates = trainable
    if host_resident_is_offloaded:
        for r in trainable:
            r.offloaded = r.local.device.type == "cpu"
        candidates = [r for r in trainable if not r.offloaded]
    total = sum(r.numel for r in candidates)
    target = offload_fraction * total
    seen = 0
    for record in candidates:
        if offload_fraction >= 1.0:
            record.offloaded = True
        elif offload_fraction <= 0.0:
            record.offloaded = False
        else:
            record.offloaded = seen + record.numel / 2 <= target and not math.isclose(target, 0.0)
        seen += record.numel
