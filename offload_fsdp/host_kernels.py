"""Host kernels: a bucketed host update for one optimizer class, and the registry that finds it.

A host bucket (:mod:`offload_fsdp.buckets`) is a flat run of offloaded local
shards. Stepping it with one ordinary optimizer instance per bucket works for any
class (:class:`offload_fsdp.delegate.DelegatedOptimizer`), but a *host kernel*
steps the whole bucket with a few calls over flat buffers, its optimizer state
included, which is what makes the host step memory-bandwidth bound instead of
Python bound. A kernel runs over flat concatenations of local shards, so its
update must be elementwise.

A kernel says four things (:class:`HostKernel`): which groups it can run
(``unsupported``), the per-param state it keeps as flat per-bucket buffers
(``state_layout``, plus a scalar ``step`` when ``has_step``), the dtypes it
steps, and the update itself (``step_bucket``). The registry maps an optimizer
class, exactly (a subclass may change the update, so it is served only when
registered itself), to a factory called once per ``HybridDeviceOptimizer``:

* ``torch.optim.Adam`` / ``AdamW``: :class:`AdamKernel` (torch's fused CPU kernel in
  cache-sized pieces, :mod:`offload_fsdp.fused_step`, or the compiled loop,
  :mod:`offload_fsdp.compiled_step`, as ``$OFFLOAD_FSDP_HOST_STEP`` chooses);
* ``torch.optim.SGD``: :class:`SgdKernel` (torch's fused CPU SGD kernel,
  :mod:`offload_fsdp.sgd_step`).

Adding a kernel for another class: write a class with the members of
:class:`HostKernel` and call :func:`register_host_kernel` (``docs/architecture.md``,
"Where to add a second host kernel").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from offload_fsdp.compiled_step import select_host_step
from offload_fsdp.fused_step import AdamHyper, FusedScratch
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.records import ParamShard
from offload_fsdp.sgd_step import SgdHyper, sgd_bucket_step

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket

__all__ = [
    "AdamKernel",
    "HOST_KERNELS",
    "HostKernel",
    "HostKernelFactory",
    "SgdKernel",
    "host_kernel_for",
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

    def unsupported(self, group: dict[str, Any]) -> str | None:
        """The name of a setting of ``group`` it cannot run (``"amsgrad"``), or None: such a group's buckets
        run the class per bucket; turned on after construction it is refused at ``step()``."""
        ...

    def state_layout(
        self, group: dict[str, Any], master_dtype: torch.dtype, precision: PrecisionPolicy
    ) -> dict[str, torch.dtype]:
        """Torch state name -> dtype of each flat per-bucket state buffer ``group``'s buckets need.

        Each param's state holds its view of each, shaped like the local shard. Fresh
        state is zeros with ``record.placeholder_state`` True (a load clears it): a
        class that starts a buffer from the first grad (SGD's ``momentum_buffer``)
        reads the flag in ``step_bucket`` and clears it once it wrote the buffer.
        """
        ...

    def step_bucket(
        self, bucket: HostBucket, active: list[ParamShard], group: dict[str, Any], scratch: FusedScratch
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

    def step_bucket(
        self, bucket: HostBucket, active: list[ParamShard], group: dict[str, Any], scratch: FusedScratch
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

    def unsupported(self, group: dict[str, Any]) -> str | None:
        return "differentiable" if group.get("differentiable", False) else None

    def state_layout(
        self, group: dict[str, Any], master_dtype: torch.dtype, precision: PrecisionPolicy
    ) -> dict[str, torch.dtype]:
        return {"momentum_buffer": master_dtype} if group["momentum"] != 0 else {}

    def step_bucket(
        self, bucket: HostBucket, active: list[ParamShard], group: dict[str, Any], scratch: FusedScratch
    ) -> None:
        sgd_bucket_step(bucket, active, SgdHyper.from_group(group), scratch)


HOST_KERNELS: dict[type[torch.optim.Optimizer], HostKernelFactory] = {}
"""optimizer class (exactly) -> the factory of its host kernel"""


def register_host_kernel(cls: type[torch.optim.Optimizer], kernel: HostKernelFactory) -> None:
    """Serve host buckets of ``cls`` (exactly this class) with ``kernel()`` instead of one ``cls`` per bucket.

    ``kernel``: a :class:`HostKernel` class or any zero-argument callable returning
    one. Replaces an earlier registration of ``cls``. Affects optimizers built after
    the call. On sharded params ``cls`` must also be elementwise
    (:func:`offload_fsdp.per_element.register_per_element`).
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_host_kernel needs a torch.optim.Optimizer subclass, got {cls!r}")
    if not callable(kernel):
        raise TypeError(f"register_host_kernel needs a HostKernel class or factory for {cls.__name__}, got {kernel!r}")
    HOST_KERNELS[cls] = kernel


def host_kernel_for(cls: type[torch.optim.Optimizer]) -> HostKernel | None:
    """A new host kernel for ``cls`` (exact class match), or None when none is registered."""
    factory = HOST_KERNELS.get(cls)
    return factory() if factory is not None else None


register_host_kernel(torch.optim.Adam, functools.partial(AdamKernel, decoupled_default=False))
register_host_kernel(torch.optim.AdamW, functools.partial(AdamKernel, decoupled_default=True))
register_host_kernel(torch.optim.SGD, SgdKernel)
