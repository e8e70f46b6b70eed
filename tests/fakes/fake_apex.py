"""Stand-ins for NVIDIA apex's ``apex.optimizers.FusedAdam``, and for the unrelated PyPI ``apex``.

The fake FusedAdam has the keyword signature of recent NVIDIA apex and keeps
its attributes (``master_weights``, ``capturable``, ``adam_w_mode``), so the
same assertions run against the real class on a GPU machine.
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
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
    ):
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights

    def step(self, closure=None):  # pragma: no cover - never stepped in tests
        raise NotImplementedError("fake FusedAdam records arguments only")


def install(monkeypatch: pytest.MonkeyPatch) -> type:
    """Make ``import apex.optimizers`` find the fake NVIDIA apex for this test."""
    root = types.ModuleType("apex")
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedAdam = FusedAdam
    root.optimizers = optimizers
    monkeypatch.setitem(sys.modules, "apex", root)
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)
    return FusedAdam


def install_pypi_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import apex`` find a package without ``apex.optimizers``, like the unrelated PyPI ``apex``."""
    root = types.ModuleType("apex")
    root.__file__ = "/site-packages/apex/__init__.py"
    monkeypatch.setitem(sys.modules, "apex", root)
    monkeypatch.setitem(sys.modules, "apex.optimizers", None)
