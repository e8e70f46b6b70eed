"""The optimizer a ``HybridDeviceOptimizer`` wraps: its groups shared, its state taken over, its own use refused.

``HybridDeviceOptimizer(torch.optim.AdamW(...))`` takes over the wrapped optimizer's class,
groups (the same dicts: a scheduler attached to it before wrapping keeps working), and state.
From then on the wrapper holds the state and updates the params, so the wrapped optimizer's own
``step()``, ``state_dict()`` and ``load_state_dict()`` raise, naming the fix, instead of a second,
divergent update or a checkpoint without Adam's state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WrappedLink"]


def _wrapped_use(optimizer: torch.optim.Optimizer, call: str) -> ValueError:
    return ValueError(
        f"this {type(optimizer).__name__} is wrapped by a HybridDeviceOptimizer, which holds its state and "
        f"updates its params; call {call} on the HybridDeviceOptimizer (e.g. pass the wrapper, not the "
        "wrapped optimizer, to your trainer and to checkpoint.save / checkpoint.load)"
    )


def _refuse_wrapped_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook on a wrapped optimizer: ``ValueError`` instead of a second, divergent update."""
    raise _wrapped_use(optimizer, "step()")


def _refuse_wrapped_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """State-dict pre-hook on a wrapped optimizer: its own state is empty or stale, so saving it loses Adam's."""
    raise _wrapped_use(optimizer, "state_dict()")


def _refuse_wrapped_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load pre-hook on a wrapped optimizer: state loaded into it would never reach the wrapper's updates."""
    raise _wrapped_use(optimizer, "load_state_dict()")


class WrappedLink:
    """The wrapped optimizer (held weakly), or none: every member is then a no-op."""

    def __init__(self, wrapped: torch.optim.Optimizer | None) -> None:
        self._ref = weakref.ref(wrapped) if wrapped is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._ref() if self._ref is not None else None

    def share_groups(self, groups: list[dict[str, Any]]) -> None:
        """One list of groups for both: a group added through either is seen by a scheduler on the wrapped
        optimizer (as torch's would be), and step() refuses one added behind the wrapper's back (through
        the wrapped one) instead of never updating it."""
        wrapped = self.optimizer
        if wrapped is None:
            return
        try:
            wrapped.param_groups = groups
        except AttributeError as exc:  # a read-only property (an optimizer wrapping another)
            raise TypeError(
                f"cannot take over the param groups of {type(wrapped).__name__} ({exc}); wrap the optimizer "
                "it wraps, or pass the params and cpu_optimizer_cls= instead"
            ) from exc

    def take_over(self, load_state_dict: Callable[[dict[str, Any]], None]) -> None:
        """Once the wrapper is built (a failed wrap leaves the optimizer usable on its own): its state is
        loaded into the wrapper, and its own step / state_dict / load_state_dict refuse from then on."""
        wrapped = self.optimizer
        if wrapped is None:
            return
        # Its own step would update the params from its own (stale or empty) state.
        wrapped.register_step_pre_hook(_refuse_wrapped_step)
        if wrapped.state:
            load_state_dict(wrapped.state_dict())
        wrapped.register_state_dict_pre_hook(_refuse_wrapped_state_dict)
        wrapped.register_load_state_dict_pre_hook(_refuse_wrapped_load)

    def check_groups_placed(self, groups: int, placed: int) -> None:
        """``ValueError`` for a param group that got no update space (added to the wrapped optimizer)."""
        if groups > placed:
            wrapped = self.optimizer
            raise ValueError(
                f"param group {placed} was added to the wrapped "
                f"{type(wrapped).__name__ if wrapped is not None else 'optimizer'} after it was wrapped, so "
                "HybridDeviceOptimizer made no update space for its params and would never update them; "
                "call add_param_group on the HybridDeviceOptimizer instead"
            )

    def mark_stepped(self) -> None:
        """Tell a scheduler attached to the wrapped optimizer that its optimizer stepped.

        torch's LRScheduler warns "lr_scheduler.step() before optimizer.step()" unless the
        optimizer it was built on set the private flag ``_opt_called`` (its patched ``step``
        does); no public API exists. If torch renames it, only that spurious warning returns.
        """
        wrapped = self.optimizer
        if wrapped is not None:
            wrapped._opt_called = True  # type: ignore[attr-defined]  # set by torch's patched step; see above
