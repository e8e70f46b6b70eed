"""Creating an optimizer's empty (fresh) per-parameter state: the one place that does it.

Both callers need state to exist before a step: an in-place checkpoint load
needs tensors to fill (:func:`checkpoint_state`, used by ``checkpoint/``), and
``HybridDeviceOptimizer``'s delegates create their inner class's state the same
way (:class:`offload_fsdp.delegate.DelegatedOptimizer`). Fresh means exactly what
the class's own first step creates *before* it updates anything: ``step`` 0,
moments zero, Rprop's step sizes and ASGD's ``eta`` at ``lr``. No parameter is
changed and no update runs.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CheckpointStateOwner", "StateMaterializer", "checkpoint_state", "create_fresh_state", "materialize_state"]


@runtime_checkable
class CheckpointStateOwner(Protocol):
    """An optimizer that produces its own checkpoint state: ``HybridDeviceOptimizer``, and a torch
    optimizer under ``optim.enable_main_params`` (which adds the method to the instance).

    ``checkpoint_state(for_save=True)``: the torch-convention state dict to save (it decides
    itself what is redundant, e.g. a master equal to its weight). ``for_save=False``: every
    param's fresh state created first; a state dict whose tensors are the optimizer's own, for a
    loader to fill in place and hand back to ``load_state_dict``.
    """

    def checkpoint_state(self, *, for_save: bool) -> dict[str, Any]: ...


def checkpoint_state(optimizer: torch.optim.Optimizer, *, for_save: bool) -> tuple[dict[str, Any], set[int]]:
    """(the state dict a checkpoint saves or loads into, the ids of params whose state was created for it).

    A :class:`CheckpointStateOwner` makes its own; any other optimizer gives ``state_dict()``,
    after :func:`create_fresh_state` for a load. The id set is empty for a save; for a load it
    names every param that had no state (a loader drops that state again if the checkpoint has none).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fresh = set() if for_save else {id(p) for p in params if not optimizer.state.get(p)}
    if isinstance(optimizer, CheckpointStateOwner):
        return optimizer.checkpoint_state(for_save=for_save), fresh
    if fresh:
        create_fresh_state(optimizer, [p for p in params if id(p) in fresh])
    return optimizer.state_dict(), fresh


@runtime_checkable
class StateMaterializer(Protocol):
    """An optimizer whose state is not created by ``create_fresh_state`` over its ``param_groups``
    (``HybridDeviceOptimizer``: the state lives in host buckets and delegates); it creates its own."""

    def materialize_state(self) -> None: ...


def materialize_state(optimizer: torch.optim.Optimizer) -> set[int]:
    """Give every parameter of ``optimizer`` without state its fresh state; return those parameters' ids.

    A :class:`StateMaterializer` creates its own; any other optimizer gets
    :func:`create_fresh_state`. Parameters, their gradients and existing state
    are left untouched.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:
        return set()
    if isinstance(optimizer, StateMaterializer):
        optimizer.materialize_state()
    else:
        create_fresh_state(optimizer, missing)
    return {id(p) for p in missing}


@torch.no_grad()
def create_fresh_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """Create the fresh state of ``params`` (members of ``optimizer.param_groups`` without state).

    torch's built-in classes create first-step state in ``_init_group`` before the
    update: that is called with zero gradients, so the state is exactly torch's.
    A class without one (or whose state appears only after the update, as SGD's
    ``momentum_buffer``) gets :func:`_state_from_a_throwaway_step`: the state's
    shapes and dtypes, zero-filled.
    """
    wanted = {id(p) for p in params}
    for group in optimizer.param_groups:
        mine = [p for p in group["params"] if id(p) in wanted and not optimizer.state.get(p)]
        if mine and _has_init_group(optimizer):
            _init_group_with_zero_grads(optimizer, group, mine)
        rest = [p for p in mine if not optimizer.state.get(p)]
        if rest:
            _state_from_a_throwaway_step(optimizer, group, rest)


def _has_init_group(optimizer: torch.optim.Optimizer) -> bool:
    # Private torch API with no public equivalent: torch's own classes create their lazy
    # state there. Only trusted for torch's classes (a subclass's may differ in meaning);
    # if torch renames it, every class takes the throw-away-step path (zeros) instead.
    # tests/test_offload_fresh_state.py pins it.
    return type(optimizer).__module__.startswith("torch.optim.") and hasattr(optimizer, "_init_group")


def _init_group_with_zero_grads(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list) -> None:
    """Run ``optimizer._init_group`` for ``params`` only (each with a zero gradient, restored after)."""
    # Every built-in _init_group takes (group, params, grads, <one output list per state name>...).
    n_lists = len(inspect.signature(optimizer._init_group).parameters) - 1  # type: ignore[attr-defined]
    saved_grads = [p.grad for p in params]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        # _init_group looks at group["params"] (and their grads): give it just ours.
        optimizer._init_group({**group, "params": params}, *([] for _ in range(n_lists)))  # type: ignore[attr-defined]
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def _state_from_a_throwaway_step(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list) -> None:
    """Step a shallow copy of ``optimizer`` over clones of ``params``; keep its state's layout, zero-filled.

    The copy has its own state and groups, so neither the real parameters nor the
    real state see the step. Values the class would start elsewhere than zero
    cannot be known here: the state is a placeholder to load into.
    """
    clones = [p.detach().clone().requires_grad_(p.requires_grad) for p in params]
    for c in clones:
        c.grad = torch.zeros_like(c)
    throwaway = type(optimizer).__new__(type(optimizer))
    throwaway.__dict__.update(optimizer.__dict__)
    throwaway.state = defaultdict(dict)
    throwaway.param_groups = [{**group, "params": clones}]
    for name, value in optimizer.__dict__.items():
        if name.endswith("_hooks") and isinstance(value, dict):
            setattr(throwaway, name, type(value)())  # the user's step hooks must not see this step
    # The class's step, not the instance attribute: an LR scheduler wraps that one around the real optimizer.
    type(optimizer).step(throwaway)
    for p, c in zip(params, clones):
        optimizer.state[p] = {k: _zero_like(v) for k, v in throwaway.state.get(c, {}).items()}


def _zero_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return type(value)(0) if isinstance(value, (int, float)) else value
