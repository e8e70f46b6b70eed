"""Per-module waits for the params' H2D (the optimizer's ``model=`` argument).

Without ``model=`` the main stream waits for the last H2D of a step as a whole
(``end_step``), so the next forward starts only when every bucket's params have
landed. Given the model, each module that owns offloaded params gets a forward
pre-hook that makes the main stream wait only for the H2D of *its* buckets, so the
first layers' forward can run while later buckets' params are still travelling.

Which module owns a param: under FSDP2, the ``fully_shard`` unit that manages it
(the nearest ``FSDPModule`` at or above the module registering it: its pre-forward
all-gather reads the sharded param); otherwise the module that registers it.
A tied param has several owners, each of which waits.

Precondition (why the argument is opt-in): every read of an offloaded param after
``step()`` goes through its owner's forward. Code that reads params directly (a
checkpoint save right after ``step()``, an EMA update, logging, FSDP2 explicit
forward prefetching of the next unit) must call ``optimizer.wait_for_params()`` first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from offload_fsdp.buckets import HostBucket

__all__ = ["owners_of_buckets", "register_forward_waits"]


def _owners(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """id(param) -> the modules whose forward must wait for it (see the module doc)."""
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    owners: dict[int, list[torch.nn.Module]] = {}

    def visit(module: torch.nn.Module, unit: torch.nn.Module) -> None:
        if isinstance(module, FSDPModule):
            unit = module
        owner = unit if fsdp else module
        for p in module.parameters(recurse=False):
            mine = owners.setdefault(id(p), [])
            if all(o is not owner for o in mine):
                mine.append(owner)
        for child in module.children():
            visit(child, unit)

    visit(model, model)
    return owners


def owners_of_buckets(
    model: torch.nn.Module, buckets: list[HostBucket]
) -> list[tuple[torch.nn.Module, list[HostBucket]]]:
    """(module, the buckets its forward waits for), for every module owning an offloaded param.

    Raises ``ValueError`` naming an offloaded param that ``model`` does not hold (its
    H2D would be waited on by no forward).
    """
    owners = _owners(model)
    waits: dict[int, tuple[torch.nn.Module, list[HostBucket]]] = {}
    for bucket in buckets:
        for r in bucket.records:
            modules = owners.get(id(r.param))
            if not modules:
                raise ValueError(
                    f"parameter {r.name!r} is offloaded but not a parameter of the model= passed to "
                    "HybridDeviceOptimizer, so no forward would wait for its host-to-device copy; pass the "
                    "model that holds every optimized parameter (after fully_shard), or leave model= unset"
                )
            for m in modules:
                entry = waits.setdefault(id(m), (m, []))
                if all(b is not bucket for b in entry[1]):
                    entry[1].append(bucket)
    return list(waits.values())


def register_forward_waits(
    waits: list[tuple[torch.nn.Module, list[HostBucket]]], wait: Callable[[HostBucket], None]
) -> list[Any]:
    """A forward pre-hook per module of ``waits`` (:func:`owners_of_buckets`) calling ``wait(bucket)``
    for each of its buckets; returns the handles."""
    handles = []
    for module, mine in waits:

        def hook(module: torch.nn.Module, args: Any, mine: list[HostBucket] = mine) -> None:
            for bucket in mine:
                wait(bucket)

        # prepend: before FSDP2's own pre-forward hook, whose all-gather reads the sharded params
        handles.append(module.register_forward_pre_hook(hook, prepend=True))
    return handles
