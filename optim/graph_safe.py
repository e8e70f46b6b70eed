"""CUDA-graph-safe gradients: every gradient is a view of one persistent flat buffer.

A captured CUDA graph replays fixed device addresses. If ``zero_grad`` frees
gradients (``set_to_none=True``, torch's default) the next backward allocates
new ones at other addresses and a graph captured over the optimizer step reads
stale memory. :func:`graph_safe_grads` allocates one flat buffer per (device,
dtype), points each parameter's gradient slot at a view of it, and zeroes in
place, so the addresses never change.

Autograd accumulates into an existing ``.grad`` in place, so backward writes
straight into the views. Rules that keep it that way (also in docs/optim.md):

* clear gradients with :meth:`GraphSafeGrads.zero_` (or
  ``optimizer.zero_grad(set_to_none=False)``), never with ``set_to_none=True``;
* do not assign ``param.grad = ...``; copy into it instead.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from offload_fsdp.grad import get_grad, set_grad
from offload_fsdp.host_memory import ALIGN_BYTES

__all__ = ["GraphSafeGrads", "graph_safe_grads"]


class GraphSafeGrads:
    """The flat gradient buffers of a set of params and the views handed out to them."""

    def __init__(self, buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor]) -> None:
        self.buffers = buffers
        """(device, dtype) -> the flat buffer every gradient of that kind is a view of"""

    def zero_(self) -> None:
        """Zero every gradient in place (one fill per buffer); addresses are kept."""
        for buffer in self.buffers.values():
            buffer.zero_()


def _aligned(numel: int, dtype: torch.dtype) -> int:
    per = max(1, ALIGN_BYTES // dtype.itemsize)  # each view starts as aligned as a host arena's
    return -(-numel // per) * per


def graph_safe_grads(params: Iterable[torch.Tensor], *, grad_dtype: torch.dtype | None = None) -> GraphSafeGrads:
    """Give every param a zeroed gradient that is a view of a persistent flat buffer.

    ``grad_dtype=None`` keeps each param's dtype (the view goes to ``.grad``);
    otherwise gradients are ``grad_dtype`` and, for params of another dtype, the
    view goes to ``decoupled_grad`` (the :mod:`offload_fsdp.grad` protocol). Each param's
    existing gradient (as :func:`~offload_fsdp.grad.get_grad` reads it) is copied into
    its view, cast if the dtype differs, and the other slot is cleared, so
    ``get_grad`` returns the view. Plain tensors only: a DTensor's
    gradient is allocated by its FSDP implementation, which this cannot pin.
    Side effect: replaces ``.grad`` / ``decoupled_grad`` of every param.
    """
    params = list(params)
    layout: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, int]]] = defaultdict(list)
    sizes: dict[tuple[torch.device, torch.dtype], int] = defaultdict(int)
    for param in params:
        if isinstance(param, DTensor):
            raise TypeError(
                "graph_safe_grads takes plain (local-shard) tensors; a DTensor's gradient is allocated by FSDP "
                "each step: use a flat-buffer FSDP whose gradient buffer is persistent instead"
            )
        key = (param.device, grad_dtype or param.dtype)
        layout[key].append((param, sizes[key]))
        sizes[key] += _aligned(param.numel(), key[1])
    buffers = {key: torch.zeros(size, dtype=key[1], device=key[0]) for key, size in sizes.items()}
    for key, entries in layout.items():
        for param, offset in entries:
            view = buffers[key][offset : offset + param.numel()].view(param.shape)
            old = get_grad(param)
            if old is not None:
                view.copy_(old)  # casts when the gradient changes slot (dtype)
            set_grad(param, view)  # also clears the other slot, so get_grad reads the view
    return GraphSafeGrads(buffers)
