"""Optimizer edges (issue 25 item 8): torch's behaviour, or a clear error where torch's cannot be had.

* A state dict saved by another class: torch's ``AdamW.load_state_dict`` takes an SGD state
  dict and its next step raises ``KeyError: 'betas'``; ``HybridDeviceOptimizer`` refuses it at
  the load, naming the missing hyper-parameters, and is left as it was.
* ``overlap_step_with_backward=True`` and a backward that raises after some host updates ran:
  torch's optimizer has applied nothing (a loop that catches the error zero-grads and goes on),
  but those buckets' masters and state already hold the update. ``step()``, ``zero_grad()`` and
  ``state_dict()`` refuse with the fix (no partial update is ever written into the model);
  ``load_state_dict`` from the last checkpoint ends the step, and training goes on exactly as if
  the failed backward had never run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer

WIDTH = 8
HYPER = {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.1}


def _sgd_state_dict() -> dict:
    q = torch.nn.Parameter(torch.ones(4))
    sgd = torch.optim.SGD([q], lr=0.1)
    q.grad = torch.ones(4)
    sgd.step()
    return sgd.state_dict()


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_plain_sgd_state_dict_is_refused_at_load_where_torch_adamw_fails_at_step(fraction):
    torch_adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], **HYPER)
    torch_adamw.load_state_dict(_sgd_state_dict())
    torch_adamw.param_groups[0]["params"][0].grad = torch.ones(4)
    with pytest.raises(KeyError, match="betas"):
        torch_adamw.step()

    p, ref = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = HybridDeviceOptimizer(torch.optim.AdamW([p], **HYPER), fraction)
    with pytest.raises(ValueError, match=r"param group 0 has no \['betas', 'eps'\].*another optimizer class"):
        opt.load_state_dict(_sgd_state_dict())
    # Left as it was: it steps as AdamW does.
    ref_opt = torch.optim.AdamW([ref], **HYPER)
    p.grad, ref.grad = torch.ones(4), torch.ones(4)
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)


def test_an_adamw_state_dict_from_an_older_torch_without_newer_keys_still_loads():
    # torch's AdamW.__setstate__ fills keys older versions did not save; they are not "missing".
    q = torch.nn.Parameter(torch.ones(4))
    saved = torch.optim.AdamW([q], **HYPER).state_dict()
    for key in ("decoupled_weight_decay", "fused", "maximize", "foreach", "capturable", "differentiable"):
        saved["param_groups"][0].pop(key)
    opt = HybridDeviceOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], **HYPER), 1.0)
    opt.load_state_dict(saved)


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (an error in the middle of a backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailingBackward.armed:
            raise RuntimeError("backward failed halfway")
        return grad


class _Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index == 2:  # backward reaches layers 3 and 2 (their buckets update), then raises
                x = _FailingBackward.apply(x)
            x = torch.tanh(layer(x))
        return x


def _setup(dtype: torch.dtype) -> tuple[_Net, HybridDeviceOptimizer]:
    torch.manual_seed(0)
    model = _Net(dtype)
    # One bucket per layer (72 elements each), so the layers after the failing point update during backward.
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, bucket_numel=80, overlap_step_with_backward=True, **HYPER
    )
    return model, opt


def _backward(model: _Net, step: int, dtype: torch.dtype) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)).to(dtype)
    model(x).float().square().mean().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("save", ["state_dict", "checkpoint_state"])
def test_after_an_overlapped_backward_raised_the_partial_update_is_refused_until_a_load_ends_it(dtype, save):
    model, opt = _setup(dtype)
    reference, ref_opt = _setup(dtype)
    for m, o in ((model, opt), (reference, ref_opt)):
        _backward(m, 0, dtype)
        o.step()
        o.zero_grad()
    saved = opt.state_dict() if save == "state_dict" else opt.checkpoint_state(for_save=True)
    saved = copy.deepcopy(saved)  # as a checkpoint holds it
    weights = [p.detach().clone() for p in model.parameters()]

    _FailingBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="backward failed halfway"):
            _backward(model, 1, dtype)
    finally:
        _FailingBackward.armed = False
    for call in (opt.step, opt.zero_grad, opt.state_dict):
        with pytest.raises(RuntimeError, match=r"raised before it finished.*load the optimizer state"):
            call()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), "a partial update reached the model"

    opt.load_state_dict(saved)  # ends the failed step
    opt.zero_grad()
    for m, o in ((model, opt), (reference, ref_opt)):  # as if the failed backward had never run
        for step in (2, 3):
            _backward(m, step, dtype)
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_backward_that_raised_before_any_update_started_leaves_zero_grad_as_in_torch():
    model, opt = _setup(torch.float32)
    _FailingBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="backward failed halfway"):
            # raises at its first node, before any param has a grad
            _FailingBackward.apply(model(torch.randn(4, WIDTH))).sum().backward()
    finally:
        _FailingBackward.armed = False
    opt.zero_grad()
    _backward(model, 0, torch.float32)
    opt.step()
