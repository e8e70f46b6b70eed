"""Who owns the trainable params' gradient tensors: autograd (default) or persistent buffers (``graph_safe_grads``).

One object per mode, so ``zero_grad`` and placing new params ask it instead of testing
the setting: :class:`AutogradGrads` leaves gradients to autograd and zeroes them as torch
does; :class:`PersistentGrads` makes them views of flat buffers (:mod:`offload_fsdp.graph_safe`)
and always zeroes those in place, whatever ``set_to_none`` says, so a captured CUDA graph
keeps writing into the gradients the step reads.
"""

from __future__ import annotations

from typing import Protocol

import torch

from offload_fsdp.grad import zero_grad as zero_grads  # both slots: .grad and decoupled_grad
from offload_fsdp.graph_safe import GraphSafeGrads, graph_safe_grads
from offload_fsdp.records import ParamShard

__all__ = ["AutogradGrads", "GradSlots", "PersistentGrads", "grad_slots_for"]


class GradSlots(Protocol):
    """What ``HybridDeviceOptimizer`` asks about its params' gradient tensors."""

    def keep(self, records: list[ParamShard]) -> None:
        """New ``records`` were placed."""

    def zero(self, records: list[ParamShard], *, set_to_none: bool) -> None:
        """``zero_grad`` of every record's param."""


class AutogradGrads:
    """Gradients as autograd allocates them; ``zero_grad`` as torch's."""

    def keep(self, records: list[ParamShard]) -> None:
        pass

    def zero(self, records: list[ParamShard], *, set_to_none: bool) -> None:
        zero_grads((r.param for r in records), set_to_none=set_to_none)


class PersistentGrads:
    """``graph_safe_grads=True``: every trainable param's gradient is a view of a persistent buffer.

    ``grad_dtype``: ``PrecisionPolicy.main_grads_dtype`` (its views go to ``decoupled_grad``).
    """

    def __init__(self, grad_dtype: torch.dtype | None) -> None:
        self._grad_dtype = grad_dtype
        self._buffers: list[GraphSafeGrads] = []  # one per batch of records placed

    def keep(self, records: list[ParamShard]) -> None:
        trainable = [r.param for r in records if r.trainable]
        self._buffers.append(graph_safe_grads(trainable, grad_dtype=self._grad_dtype))

    def zero(self, records: list[ParamShard], *, set_to_none: bool) -> None:
        """The buffers zeroed in place (a slot set to something else is pointed back at its view)."""
        for handle in self._buffers:
            handle.zero_()
        zero_grads((r.param for r in records if not r.trainable), set_to_none=set_to_none)


def grad_slots_for(graph_safe: bool, grad_dtype: torch.dtype | None) -> GradSlots:
    return PersistentGrads(grad_dtype) if graph_safe else AutogradGrads()
