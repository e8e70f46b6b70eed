"""Which optimizer classes may run on pieces of a tensor: the one registry.

``HybridDeviceOptimizer`` hands a delegated optimizer each parameter's *local
shard* (FSDP2's ``DTensor`` local tensor, a flat-buffer slice). That is exact only
for classes whose update is a function of each element alone (SGD, Adam, ...).
A class whose update reads whole-tensor statistics (Adafactor's row/column
factors, LAMB/LARS trust ratios, Shampoo/Muon matrix updates) would silently
compute them over the piece; such a class on a sharded parameter is refused
(:func:`check_per_element`).

It is also where a class's host kernel is found (:mod:`offload_fsdp.host_kernels`):
one registry, ``qualified class name -> kernel factory or None``, and one matching rule
(:func:`registered_name`): a class is matched by its own qualified name, else by that of
the class that implements its ``step``, so a subclass of a registered class that keeps
its ``step`` (e.g. one that only adds logging to ``__init__``) counts as registered,
kernel included, while one that overrides ``step`` (a LAMB-style trust ratio on top of
``AdamW``) must be registered itself; optional backends need not be imported to be listed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "PER_ELEMENT_OPTIMIZERS",
    "check_per_element",
    "check_steps_without_closure",
    "is_per_element",
    "qualified_name",
    "register_per_element",
    "registered_name",
]


class _Registry(dict[str, Callable[[], Any] | None]):
    """qualified class name -> host kernel factory or None; also takes the set calls of the set it once was."""

    def add(self, name: str) -> None:
        self.setdefault(name, None)

    def discard(self, name: str) -> None:
        self.pop(name, None)


PER_ELEMENT_OPTIMIZERS = _Registry(
    (name, None)
    for name in [
        "torch.optim.sgd.SGD",
        "torch.optim.adam.Adam",
        "torch.optim.adamw.AdamW",
        "torch.optim.adamax.Adamax",
        "torch.optim.nadam.NAdam",
        "torch.optim.radam.RAdam",
        "torch.optim.rmsprop.RMSprop",
        "torch.optim.adagrad.Adagrad",
        "torch.optim.adadelta.Adadelta",
        "torch.optim.asgd.ASGD",
        "torch.optim.rprop.Rprop",
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
        "apex.optimizers.fused_adam.FusedAdam",
    ]
)
"""The one registry: qualified name (``module.qualname``) of each class whose update is elementwise ->
the factory of its host kernel (:func:`offload_fsdp.host_kernels.register_host_kernel`), or None (its
host buckets run the class itself)."""


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_per_element(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Declare ``cls`` elementwise, so it may run on local shards; returns ``cls`` (usable as a decorator)."""
    PER_ELEMENT_OPTIMIZERS.setdefault(qualified_name(cls), None)
    return cls


def _step_owner(cls: type[torch.optim.Optimizer]) -> str:
    """Qualified name of the class whose ``step`` ``cls`` runs.

    Unwrapped first: torch's ``Optimizer.__init__`` stores a profiling wrapper of the
    inherited ``step`` on the first class instantiated, so ``vars(cls)`` may hold a
    ``step`` the class never wrote.
    """
    step = inspect.unwrap(cls.step)
    # A callable object (no __qualname__) as step names no class: never registered.
    return f"{getattr(step, '__module__', '')}.{getattr(step, '__qualname__', '').rpartition('.')[0]}"


def registered_name(cls: type[torch.optim.Optimizer]) -> str | None:
    """The one matching rule: ``cls``'s own qualified name if registered, else that of the class
    implementing ``cls.step`` if registered, else None."""
    for name in (qualified_name(cls), _step_owner(cls)):
        if name in PER_ELEMENT_OPTIMIZERS:
            return name
    return None


def is_per_element(cls: type[torch.optim.Optimizer]) -> bool:
    """True when ``cls`` is registered as elementwise (:func:`registered_name`)."""
    return registered_name(cls) is not None


def check_steps_without_closure(cls: type[torch.optim.Optimizer], arg: str) -> None:
    """Raise ``ValueError`` when ``cls.step`` requires a closure (``torch.optim.LBFGS``).

    The delegated instances are stepped per bucket without one; such a class also
    re-evaluates the model and couples all its parameters, which no per-bucket run reproduces.
    """
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{arg}={cls.__name__} needs a closure at every step (it re-evaluates the loss and its update "
            "spans all parameters together), which HybridDeviceOptimizer cannot run per bucket; use "
            f"{cls.__name__} directly, without HybridDeviceOptimizer"
        )


def check_per_element(
    cls: type[torch.optim.Optimizer], param_name: str, local_shape: tuple[int, ...], global_shape: tuple[int, ...]
) -> None:
    """Raise ``ValueError`` unless ``cls`` may update the local shard of the named sharded parameter."""
    if is_per_element(cls):
        return
    raise ValueError(
        f"{cls.__name__} is not known to update each element independently, and parameter {param_name!r} is "
        f"sharded (local shape {tuple(local_shape)} of {tuple(global_shape)}): running it on the local shard would "
        f"silently differ from {cls.__name__} on the whole tensor (e.g. Adafactor's row/column factors, LAMB's "
        "trust ratio). Put this parameter in a param group of its own that is not sharded (leave its module out "
        "of fully_shard), optimise it with an elementwise class (e.g. torch.optim.AdamW), or, if "
        f"{cls.__name__}'s update is elementwise, declare it with "
        "offload_fsdp.per_element.register_per_element(cls)"
    )
