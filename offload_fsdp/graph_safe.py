"""CUDA-graph-safe gradients: every gradient is a view of one persistent flat buffer.

A captured CUDA graph replays fixed device addresses. If ``zero_grad`` frees
gradients (``set_to_none=True``, torch's default) the next backward allocates
new ones at other addresses and a graph captured over backward or the optimizer
step reads stale memory. :func:`graph_safe_grads` allocates one flat buffer per
(device, dtype), points each parameter's gradient slot at a view of it, and
zeroes in place, so the addresses never change. The "views" are aliases of their
slices with version counters of their own (see :func:`graph_safe_grads`).

Autograd accumulates into an existing ``.grad`` in place, so backward writes
straight into the views (a ``decoupled_grad`` view is written by whatever
produces main grads, e.g. Megatron-FSDP / Transformer Engine hooks).

The path users take keeps them: ``HybridDeviceOptimizer(..., graph_safe_grads=True)``
and ``optim.build_optimizer(..., graph_safe_grads=True)`` (:func:`keep_grad_buffers`)
make the optimizer's ``zero_grad`` zero the buffers in place whatever its
``set_to_none`` says. Rules that keep it that way (also in docs/optim.md): clear
gradients through that ``zero_grad`` or :meth:`GraphSafeGrads.zero_`; do not
assign ``param.grad = ...`` (copy into it). A slot set to something else is
pointed back at its view by the next ``zero_()``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from offload_fsdp.grad import get_grad, set_grad
from offload_fsdp.host_memory import ALIGN_BYTES

__all__ = ["GraphSafeGrads", "graph_safe_grads", "keep_grad_buffers"]


class GraphSafeGrads:
    """The flat gradient buffers of a set of params and the views handed out to them."""

    def __init__(
        self,
        buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor],
        views: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.buffers = buffers
        """(device, dtype) -> the flat buffer every gradient of that kind is a view of"""
        self.views = views
        """(param, its gradient view), in the order the params were given"""

    def zero_(self) -> None:
        """Zero every gradient in place (one fill per buffer); addresses are kept.

        A param whose gradient slot no longer holds its view (set to None, or assigned)
        is pointed back at it, so the next backward writes into the buffer again.
        """
        for buffer in self.buffers.values():
            buffer.zero_()
        for param, view in self.views:
            if get_grad(param) is not view:
                set_grad(param, view)


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
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, entries in layout.items():
        for param, offset in entries:
            # An alias of the slice, not a view: a view shares the whole buffer's version counter, so
            # accumulating into one param's grad would look like an in-place edit of every other grad
            # (records.grad_key: re-staged D2H, and the overlapped step's "grad changed" refusal).
            strides = torch.empty(param.shape, device="meta").stride()  # contiguous
            view = torch.empty(0, dtype=key[1], device=key[0])
            view.set_(buffers[key].untyped_storage(), offset, param.shape, strides)
            old = get_grad(param)
            if old is not None:
                view.copy_(old)  # casts when the gradient changes slot (dtype)
            set_grad(param, view)  # also clears the other slot, so get_grad reads the view
            views[id(param)] = (param, view)
    return GraphSafeGrads(buffers, [views[id(p)] for p in params])


def keep_grad_buffers(optimizer: torch.optim.Optimizer, *, grad_dtype: torch.dtype | None = None) -> GraphSafeGrads:
    """Graph-safe gradients for the trainable params of ``optimizer``, kept by its ``zero_grad``.

    Side effects: every param with ``requires_grad`` gets a gradient view
    (:func:`graph_safe_grads`); ``optimizer.zero_grad`` is replaced, on this
    instance only (torch.optim has no zero_grad hook; the class is untouched), by
    :meth:`GraphSafeGrads.zero_`: in place whatever ``set_to_none`` says, since
    freeing the buffers is what a captured graph cannot survive. Returns the handle.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    handle = graph_safe_grads(params, grad_dtype=grad_dtype)

    def zero_grad(set_to_none: bool = True) -> None:
        handle.zero_()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    return handle
