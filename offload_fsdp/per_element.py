"""Which optimizer classes may run on pieces of a tensor: the one registry.

``HybridDeviceOptimizer`` hands a delegated optimizer each parameter's *local
shard* (FSDP2's ``DTensor`` local tensor, a flat-buffer slice). That is exact only
for classes whose update is a function of each element alone (SGD, Adam, ...).
A class whose update reads whole-tensor statistics (Adafactor's row/column
factors, LAMB/LARS trust ratios, Shampoo/Muon matrix updates) would silently
compute them over the piece; such a class on a sharded parameter is refused
(:func:`check_per_element`).

Classes are matched by qualified name over their MRO, so a subclass of a
registered class (e.g. a ``FusedAdam`` adapter) counts as registered and
optional backends need not be imported to be listed.
"""

from __future__ import annotations

import torch

__all__ = ["PER_ELEMENT_OPTIMIZERS", "check_per_element", "is_per_element", "register_per_element"]

PER_ELEMENT_OPTIMIZERS: set[str] = {
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
}
"""Qualified names (``module.qualname``) of classes whose update is elementwise."""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_per_element(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Declare ``cls`` elementwise, so it may run on local shards; returns ``cls`` (usable as a decorator)."""
    PER_ELEMENT_OPTIMIZERS.add(_qualified(cls))
    return cls


def is_per_element(cls: type) -> bool:
    """True when ``cls`` or one of its bases is registered as elementwise."""
    return any(_qualified(base) in PER_ELEMENT_OPTIMIZERS for base in cls.__mro__)


def check_per_element(cls: type, param_name: str, local_shape: tuple[int, ...], global_shape: tuple[int, ...]) -> None:
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
