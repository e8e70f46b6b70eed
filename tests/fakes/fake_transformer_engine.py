"""A stand-in for ``transformer_engine.pytorch.optimizers.FusedAdam`` that only records its configuration.

Its constructor has the keyword signature of Transformer Engine's FusedAdam and
keeps the same attributes (``master_weights``, ``use_decoupled_grad``,
``exp_avg_dtype``, ...), so one set of assertions checks the fake here and the
real class on a GPU machine. :func:`install` puts it into ``sys.modules``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch


class FusedAdam(torch.optim.Optimizer):
    """Records constructor arguments; ``step`` is not implemented."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.use_decoupled_grad = use_decoupled_grad

    def step(self, closure=None):  # pragma: no cover - never stepped in tests
        raise NotImplementedError("fake FusedAdam records arguments only")


class OldFusedAdam(torch.optim.Optimizer):
    """An old Transformer Engine FusedAdam: no decoupled grads, no state dtypes."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        *,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        super().__init__(params, dict(lr=lr))


def install(monkeypatch: pytest.MonkeyPatch, fused_adam: type = FusedAdam) -> type:
    """Make ``import transformer_engine.pytorch.optimizers`` find ``fused_adam`` for this test."""
    root = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    optimizers.FusedAdam = fused_adam
    root.pytorch, pytorch.optimizers = pytorch, optimizers
    for module in (root, pytorch, optimizers):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return fused_adam
