"""The compiled host step's reused C-call items (``compiled_step._CallItems``): same bits as building them every step."""

import shutil

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer, compiled_step, fused_step
from offload_fsdp.compiled_step import HOST_STEP_ENV
from optim import PrecisionPolicy

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) for the compiled host step")

SIZES = (37, 1000, 3, 129)
BF16_STATE = PrecisionPolicy(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


@pytest.fixture
def items_built(monkeypatch):
    """How many times a bucket's items were built (not reused)."""
    built = []
    build = compiled_step._build_call_items

    def counting(*args):
        built.append(1)
        return build(*args)

    monkeypatch.setattr(compiled_step, "_build_call_items", counting)
    return built


def _train(monkeypatch, host_step, steps, frozen=lambda step, i: False):
    """AdamW (SR on both bf16 moments) with a per-step LR schedule; param i gets no grad where ``frozen``."""
    monkeypatch.setenv(HOST_STEP_ENV, host_step)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(torch.bfloat16).requires_grad_() for n in SIZES]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fused_step, "PIECE_NUMEL", 64)  # pieces that start and end mid-record
        opt = HybridDeviceOptimizer(
            torch.optim.AdamW(params, lr=0.01, betas=(0.99, 0.999), weight_decay=0.1), 1.0, precision=BF16_STATE
        )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            g = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)
            p.grad = None if frozen(step, i) else g
        opt.step()
        sched.step()
    return [p.detach().clone() for p in params], opt.state_dict()


def _assert_identical(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for key, entry in a[1]["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, b[1]["state"][key][name]), (key, name)


def test_items_built_once_follow_a_changing_lr_and_step_count_bit_for_bit(monkeypatch, items_built):
    fused = _train(monkeypatch, "fused", 5)
    assert not items_built
    compiled = _train(monkeypatch, "compiled", 5)
    assert len(items_built) == 1  # one bucket, one layout: built at the first step, reused by the other four
    _assert_identical(fused, compiled)


def test_items_are_rebuilt_when_the_active_records_change_and_steps_differ_per_record(monkeypatch, items_built):
    def frozen(step, i):  # param 2 skips steps 1 and 2; param 0 skips step 3: three layouts, mixed step counts
        return (i == 2 and step in (1, 2)) or (i == 0 and step == 3)

    fused = _train(monkeypatch, "fused", 6, frozen)
    compiled = _train(monkeypatch, "compiled", 6, frozen)
    assert len(items_built) == 4  # all; without 2 (reused at step 2); without 0; all (reused at step 5)
    _assert_identical(fused, compiled)
