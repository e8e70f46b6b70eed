"""Host kernels: a bucketed host update for one optimizer class, and the registry that finds it.

A host bucket (:mod:`offload_fsdp.buckets`) is a flat run of offloaded local
shards. Stepping it with one ordinary optimizer instance per bucket works for any
class (:class:`offload_fsdp.delegate.DelegatedOptimizer`), but a *host kernel*
steps the whole bucket with a few calls over flat buffers, its optimizer state
included, which is what makes the host step memory-bandwidth bound instead of
Python bound. A kernel runs over flat concatenations of local shards, so its
update must be elementwise.

A kernel says five things (:class:`HostKernel`): which groups it can run
(``unsupported``), the per-param state it keeps as flat per-bucket buffers
(``state_layout``, plus a scalar ``step`` when ``has_step``), how that state
starts (``init_state``, as the class creates it, and whether the class's first
update reads it: ``first_update_replaces_state``), the dtypes it steps, and the
update itself (``step_bucket``). The one registry of :mod:`offload_fsdp.per_element`
maps an optimizer class (its own name, or that of the class implementing its
``step``) to a factory called once per ``HybridDeviceOptimizer``:

* ``torch.optim.Adam`` / ``AdamW``: :class:`AdamKernel` (torch's fused CPU kernel in
  cache-sized pieces, :mod:`offload_fsdp.fused_step`, or the compiled loop,
  :mod:`offload_fsdp.compiled_step`, as ``$OFFLOAD_FSDP_HOST_STEP`` chooses);
* ``torch.optim.SGD``: :class:`SgdKernel` (torch's fused CPU SGD kernel,
  :mod:`offload_fsdp.sgd_step`);
* ``torch.optim.Adagrad``: :class:`AdagradKernel` (torch's functional Adagrad over per-param views).

Adding a kernel for another class: write a class with the members of
:class:`HostKernel` and call :func:`register_host_kernel` (``docs/architecture.md``,
"Where to add a host kernel").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.optim.adagrad import adagrad

from offload_fsdp.compiled_step import select_host_step
from offload_fsdp.fused_step import AdamHyper, PieceScratch
from offload_fsdp.grad import local_tensor
from offload_fsdp.per_element import PER_ELEMENT_OPTIMIZERS, qualified_name, registered_name
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.records import ParamShard
from offload_fsdp.sgd_step import SgdHyper, sgd_bucket_step

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket

__all__ = [
    "AdagradKernel",
    "AdamKernel",
    "HostKernel",
    "HostKernelFactory",
    "SgdKernel",
    "first_update_replaces_state",
    "host_kernel_for",
    "init_fresh_state",
    "register_host_kernel",
]

_STEPPABLE = (torch.float32, torch.bfloat16, torch.float16)


class HostKernel(Protocol):
    """The bucketed host update of one optimizer class (see the module docstring)."""

    name: str
    """shown in messages (e.g. ``"Adam(W)"``)"""
    has_step: bool
    """each param's state holds a scalar fp32 ``step`` tensor (0 when fresh), as torch's Adam does"""
    dtypes: tuple[torch.dtype, ...]
    """param and grad dtypes it steps; a bucket with another dtype runs the class per bucket"""
    master_dtypes: tuple[torch.dtype, ...]
    """master dtypes it updates (the param's with ``param_update_in_fp32=False``); others run the class per bucket"""
    moment_dtypes_from_policy: bool
    """``PrecisionPolicy.exp_avg_dtype`` / ``exp_avg_sq_dtype`` set its state dtypes (else a warning says they
    are ignored)"""
    first_update_replaces_state: bool
    """the class's first update of a param does not read the state :meth:`init_state` created (SGD starts
    ``momentum_buffer`` from the grad): such state, never updated (``ParamShard.placeholder_state``), is only
    a place to load into, ``step_bucket`` takes the first-update path for it, and ``state_dict()`` leaves it
    out (torch's class has none yet). False: the fresh state is what the first update reads (Adam's zeros)"""

    def unsupported(self, group: dict[str, Any]) -> str | None:
        """The name of a setting of ``group`` it cannot run (``"amsgrad"``), or None: such a group's buckets
        run the class per bucket; turned on after construction it is refused at ``step()``."""
        ...

    def state_layout(
        self, group: dict[str, Any], master_dtype: torch.dtype, precision: PrecisionPolicy
    ) -> dict[str, torch.dtype]:
        """Torch state name -> dtype of each flat per-bucket state buffer ``group``'s buckets need.

        Each param's state holds its view of each, shaped like the local shard, filled by
        :meth:`init_state` when the param's state is created.
        """
        ...

    def init_state(self, group: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        """Fill one param's fresh state in place, as the class creates it before its first update.

        ``state``: the param's views of the flat state buffers (:meth:`state_layout`'s names) and,
        when ``has_step``, its ``step`` (a scalar tensor at 0). The record is then marked never
        updated (``placeholder_state``) until a load or an update; a kernel whose first update
        differs (:attr:`first_update_replaces_state`) reads that flag in ``step_bucket`` and clears it.
        """
        ...

    def step_bucket(
        self, bucket: HostBucket, active: list[ParamShard], group: dict[str, Any], scratch: PieceScratch
    ) -> None:
        """Update the ``active`` records of ``bucket`` (those with a gradient) from ``group``'s current values.

        Preconditions: grads staged in ``bucket.grad_stage`` have landed, no H2D
        reads the bucket, every active record's state exists (if the layout has
        any). Side effects: masters, state (``step`` included), and the param
        staging (``bucket.param_stage``, the cast H2D copies) of the active records.
        """
        ...


HostKernelFactory = Callable[[], HostKernel]
"""Called once per ``HybridDeviceOptimizer`` whose ``cpu_optimizer_cls`` it is registered for, at
construction (so a kernel may hold per-optimizer choices, e.g. Adam's compiled-or-fused step)."""


class AdamKernel:
    """``torch.optim.Adam`` / ``AdamW`` without ``amsgrad``: moments in the policy's dtypes, a ``step`` scalar."""

    name: str = "Adam(W)"
    has_step: bool = True
    dtypes: tuple[torch.dtype, ...] = _STEPPABLE
    master_dtypes: tuple[torch.dtype, ...] = _STEPPABLE
    moment_dtypes_from_policy: bool = True
    first_update_replaces_state: bool = False

    def __init__(self, *, decoupled_default: bool) -> None:
        self.decoupled_default = decoupled_default
        """AdamW: a group without ``decoupled_weight_decay`` decays decoupled (torch's AdamW sets it)"""
        self.host_step = select_host_step()
        """the compiled loop (default) or torch's fused kernel, read from ``$OFFLOAD_FSDP_HOST_STEP`` now"""

    def unsupported(self, group: dict[str, Any]) -> str | None:
        for setting in ("amsgrad", "differentiable"):  # amsgrad: no max_exp_avg_sq buffer here
            if group.get(setting, False):
                return setting
        return None

    def state_layout(
        self, group: dict[str, Any], master_dtype: torch.dtype, precision: PrecisionPolicy
    ) -> dict[str, torch.dtype]:
        return {"exp_avg": precision.exp_avg_dtype, "exp_avg_sq": precision.exp_avg_sq_dtype}

    def init_state(self, group: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        for name in ("exp_avg", "exp_avg_sq"):
            state[name].zero_()

    def step_bucket(
        self, bucket: HostBucket, active: list[ParamShard], group: dict[str, Any], scratch: PieceScratch
    ) -> None:
        # `_foreach_add_`: torch's multi-tensor op, no public name (optimizers use it); removed -> step raises.
        torch._foreach_add_([r.created_state["step"] for r in active], 1.0)
        hyper = AdamHyper.from_group(group, decoupled_default=self.decoupled_default)
        self.host_step(bucket, active, hyper, scratch)


class SgdKernel:
    """``torch.optim.SGD`` (momentum, dampening, nesterov, weight_decay, maximize), as ``SGD(fused=True)``.

    State: ``momentum_buffer`` in the master's dtype (fp32) when the group has momentum
    at construction (none without: plain SGD keeps no state, as in torch).
    """

    name: str = "SGD"
    has_step: bool = False
    dtypes: tuple[torch.dtype, ...] = _STEPPABLE
    # fp32 masters only: torch 2.13's fused CPU SGD kernel is wrong on bf16/fp16 tensors (its vector
    # loop never writes the params, and reads fp16 momentum as floats); tests/test_offload_host_kernels.py
    # checks it still is, so a fixed torch shows up there.
    master_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    moment_dtypes_from_policy: bool = False
    first_update_replaces_state: bool = True

    def unsupported(self, group: dict[str, Any]) -> str | None:
        return "differentiable" if group.get("differentiable", False) else None

    def state_layout(
        self, group: dict[str, Any], master_dtype: torch.dtype, precision: PrecisionPolicy
    ) -> dict[str, torch.dtype]:
        return {"momentum_buffer": master_dtype} if group["momentum"] != 0 else {}

    def init_state(self, group: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        if "momentum_buffer" in state:
            state["momentum_buffer"].zero_()  # a place to load into: the first update starts it from the grad

    def step_bucket(
        self, bucket: HostBucket, active: list[ParamShard], group: dict[str, Any], scratch: PieceScratch
    ) -> None:
        sgd_bucket_step(bucket, active, SgdHyper.from_group(group), scratch)


def init_fresh_state(kernel: HostKernel, group: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """``kernel.init_state``; zeros for a kernel written before that member existed (what they then got)."""
    init = getattr(kernel, "init_state", None)
    if init is not None:
        init(group, state)
        return
    for name, value in state.items():
        if name != "step":
            value.zero_()


def first_update_replaces_state(kernel: HostKernel) -> bool:
    """``kernel.first_update_replaces_state``; False for a kernel written before that member existed."""
    return bool(getattr(kernel, "first_update_replaces_state", False))


def register_host_kernel(cls: type[torch.optim.Optimizer], kernel: HostKernelFactory) -> None:
    """Serve host buckets of ``cls`` with ``kernel()`` instead of one ``cls`` per bucket.

    ``kernel``: a :class:`HostKernel` class or any zero-argument callable returning
    one. Registers ``cls`` in the one registry (:data:`offload_fsdp.per_element.PER_ELEMENT_OPTIMIZERS`):
    a kernel runs over flat concatenations of local shards, so ``cls`` is elementwise, and it
    is matched as every registered class is (:func:`~offload_fsdp.per_element.registered_name`:
    ``cls`` itself, or a subclass keeping its ``step``). Replaces an earlier registration of
    ``cls``. Affects optimizers built after the call.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_host_kernel needs a torch.optim.Optimizer subclass, got {cls!r}")
    if not callable(kernel):
        raise TypeError(f"register_host_kernel needs a HostKernel class or factory for {cls.__name__}, got {kernel!r}")
    PER_ELEMENT_OPTIMIZERS[qualified_name(cls)] = kernel


def host_kernel_for(cls: type[torch.optim.Optimizer]) -> HostKernel | None:
    """A new host kernel for ``cls`` (matched by :func:`~offload_fsdp.per_element.registered_name`), or None."""
    name = registered_name(cls)
    factory = PER_ELEMENT_OPTIMIZERS.get(name) if name is not None else None
    return factory() if factory is not None else None


class AdagradKernel:
    """``torch.optim.Adagrad`` (``lr_decay``, ``weight_decay``, ``initial_accumulator_value``, ``maximize``).

    Torch's own functional update over each active record's views of the flat buffers, with the
    group's ``foreach`` / ``fused`` choice, so the bits are those of ``Adagrad`` on the params (or
    on fp32 masters, the grad cast to the master's dtype as torch steps an fp32 master). State:
    ``sum`` in the master's dtype, started at ``initial_accumulator_value``, and a ``step`` scalar.
    """

    name: str = "Adagrad"
    has_step: bool = True
    dtypes: tuple[torch.dtype, ...] = _STEPPABLE
    master_dtypes: tuple[torch.dtype, ...] = _STEPPABLE
    moment_dtypes_from_policy: bool = False
    first_update_replaces_state: bool = False

    def unsupported(self, group: dict[str, Any]) -> str | None:
        return "differentiable" if group.get("differentiable", False) else None

    def state_layout(
        self, group: dict[str, Any], master_dtype: torch.dtype, precision: PrecisionPolicy
    ) -> dict[str, torch.dtype]:
        return {"sum": master_dtype}

    def init_state(self, group: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        state["sum"].fill_(group["initial_accumulator_value"])  # as Adagrad.__init__ creates it

    def step_bucket(
        self, bucket: HostBucket, active: list[ParamShard], group: dict[str, Any], scratch: PieceScratch
    ) -> None:
        masters = [r.host_master for r in active]
        grads = [r.host_grad_stage.to(m.dtype) for r, m in zip(active, masters)]  # no copy when equal
        states = [r.created_state for r in active]
        # Local views: the public state wraps them as DTensors for DTensor params.
        sums = [local_tensor(s["sum"]) for s in states]
        steps = [s["step"] for s in states]
        adagrad(
            masters, grads, sums, steps, fused=group.get("fused"), foreach=group.get("foreach"),
            lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"], eps=group["eps"],
            maximize=group.get("maximize", False),
        )  # fmt: skip
        for r in active:
            if r.param_stage is not None:
                r.param_stage.copy_(r.host_master)


register_host_kernel(torch.optim.Adam, functools.partial(AdamKernel, decoupled_default=False))
register_host_kernel(torch.optim.AdamW, functools.partial(AdamKernel, decoupled_default=True))
register_host_kernel(torch.optim.SGD, SgdKernel)
register_host_kernel(torch.optim.Adagrad, AdagradKernel)
