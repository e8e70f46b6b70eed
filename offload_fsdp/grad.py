"""The ``decoupled_grad`` protocol: one accessor for a parameter's gradient.

Mixed-precision training often keeps gradients in a dtype other than the
parameter's (fp32 main grads for bf16 params). PyTorch refuses ``param.grad`` of
another dtype, so such gradients live in ``param.decoupled_grad`` instead
(the convention of Megatron-LM and Transformer Engine). Every optimizer and
utility in this toolkit reads gradients through :func:`get_grad` only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["get_grad", "set_grad", "local_tensor", "zero_decoupled_grad", "zero_grad"]

DECOUPLED_GRAD_ATTR = "decoupled_grad"


def get_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param.decoupled_grad`` if it is set (not None), else ``param.grad``."""
    grad = getattr(param, DECOUPLED_GRAD_ATTR, None)
    return grad if grad is not None else param.grad


def set_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Store ``grad`` where :func:`get_grad` will find it.

    A gradient of the parameter's own dtype (or ``None``) goes to ``param.grad``;
    one of another dtype goes to ``param.decoupled_grad``. A stale value in the
    other slot is cleared, so the two never disagree.
    """
    if grad is None or grad.dtype == param.dtype:
        if getattr(param, DECOUPLED_GRAD_ATTR, None) is not None:
            setattr(param, DECOUPLED_GRAD_ATTR, None)
        param.grad = grad
    else:
        param.grad = None
        setattr(param, DECOUPLED_GRAD_ATTR, grad)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a tensor: a DTensor's local shard, else the tensor itself."""
    # Private `_local_tensor` (kept): for an nn.Parameter(DTensor), as FSDP2 params are, `to_local()`
    # returns a fresh view on every call (gh-166156), which breaks the identity checks of
    # ParamShard.has_master/_local_key; with grad enabled it adds an autograd node. If torch renames
    # it, every DTensor param/grad access here fails (tests/test_torch_private_uses.py names it).
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _clear_slots(params: Iterable[torch.Tensor], attrs: tuple[str, ...], set_to_none: bool) -> None:
    """Set the ``attrs`` gradient slots of every param to None, or zero them in place.

    In place, dense buffers are zeroed with one ``_foreach_zero_`` per (device, dtype),
    as ``torch.optim.Optimizer.zero_grad`` does: one kernel per group instead of one per
    param (thousands of tiny launches on a GPU). DTensor grads are zeroed through their
    local tensor (the same storage).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for param in params:
        for attr in attrs:
            grad = getattr(param, attr, None)
            if grad is None:
                continue
            if set_to_none:
                setattr(param, attr, None)
                continue
            # As torch's zero_grad: a grad built with create_graph=True leaves its graph first.
            if grad.grad_fn is not None:
                grad.detach_()
            else:
                grad.requires_grad_(False)
            if grad.is_sparse:
                grad.zero_()
            else:
                local = local_tensor(grad)
                groups[(local.device, local.dtype)].append(local)
    with torch.no_grad():
        for grads in groups.values():
            # `_foreach_zero_`: what Optimizer.zero_grad calls, no public name; removed -> zero_grad raises.
            torch._foreach_zero_(grads)


def zero_grad(params: Iterable[torch.Tensor], *, set_to_none: bool = True) -> None:
    """Clear both gradient slots (``grad`` and ``decoupled_grad``) of every param.

    ``torch.optim.Optimizer.zero_grad`` knows only ``.grad``; use this where
    gradients may be decoupled. With ``set_to_none=False`` existing buffers are
    zeroed in place (their storage, and any view of it, is kept).
    """
    _clear_slots(params, ("grad", DECOUPLED_GRAD_ATTR), set_to_none)


def zero_decoupled_grad(params: Iterable[torch.Tensor], *, set_to_none: bool = True) -> None:
    """Clear ``decoupled_grad`` only, as :func:`zero_grad` does; for use after an optimizer cleared ``.grad``."""
    _clear_slots(params, (DECOUPLED_GRAD_ATTR,), set_to_none)
