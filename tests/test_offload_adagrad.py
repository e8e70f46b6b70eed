"""The Adagrad host kernel (:class:`offload_fsdp.host_kernels.AdagradKernel`) against ``torch.optim.Adagrad``, bit for bit.

It is the third kernel, written against the documented extension point (``HostKernel``,
``register_host_kernel``): its state starts where torch's does (``sum`` at
``initial_accumulator_value``, ``init_state``), including after ``materialize_state`` and a
resume from that state. bf16 params are compared with torch stepping fp32 copies (the
masters) on the same grads. Stated tolerance: none (``torch.equal``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import offload_fsdp
from offload_fsdp import HybridDeviceOptimizer, register_host_kernel
from offload_fsdp.host_kernels import AdagradKernel, HostKernel, host_kernel_for

BF16, FP32 = torch.bfloat16, torch.float32
SHAPES = [(7, 3), (5,), (4, 4), (0, 3), (6,)]  # an empty shard included
HYPER: dict[str, Any] = dict(lr=0.05, lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.3, eps=1e-8)


def _params(dtype: torch.dtype = FP32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.02, "maximize": True}]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, stop: int) -> None:
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(1000 + step)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen).bfloat16()  # bf16 values: exact in every dtype used here
            p.grad = None if (step == 1 and i == 1) else g.to(p.dtype)  # a param without a grad one step
        opt.step()


def _assert_matches(opt, params, ref_opt, ref) -> None:
    for i, (p, q) in enumerate(zip(params, ref)):
        state, ref_state = opt.state[p], ref_opt.state[q]
        master = state.get("master_param", p)
        assert torch.equal(master, q), i
        assert torch.equal(p, q.to(p.dtype)), i
        assert torch.equal(state["sum"], ref_state["sum"]), i
        assert torch.equal(state["step"], ref_state["step"]), i


class _Counting(AdagradKernel):
    stepped = 0

    def step_bucket(self, bucket, active, group, scratch):
        _Counting.stepped += len(active)
        super().step_bucket(bucket, active, group, scratch)


@pytest.fixture
def counting_kernel():
    _Counting.stepped = 0
    register_host_kernel(torch.optim.Adagrad, _Counting)
    yield _Counting
    register_host_kernel(torch.optim.Adagrad, AdagradKernel)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_the_adagrad_host_kernel_matches_torch_adagrad_bit_for_bit(dtype, fraction, counting_kernel):
    ours = _params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]
    # The explicit form: a wrapped bf16 Adagrad would hand over the state torch made in its __init__ (its sum
    # rounded to bf16); here the host kernel creates the fp32 masters' state, as torch does on fp32 params.
    opt = HybridDeviceOptimizer(_groups(ours), fraction, cpu_optimizer_cls=torch.optim.Adagrad, **HYPER)
    ref_opt = torch.optim.Adagrad(_groups(ref), **HYPER)
    _run(opt, ours, 0, 4)
    _run(ref_opt, ref, 0, 4)
    _assert_matches(opt, ours, ref_opt, ref)
    assert counting_kernel.stepped > 0  # the kernel, not a delegated Adagrad, stepped the host share


def test_fresh_state_after_materialize_state_is_torch_adagrads_and_resumes_bit_exact(counting_kernel):
    straight, saved_from, resumed = _params(), _params(), _params()
    ref = [p.detach().clone().requires_grad_() for p in straight]
    ref_opt = torch.optim.Adagrad(_groups(ref), **HYPER)  # torch creates its state in __init__
    straight_opt = HybridDeviceOptimizer(torch.optim.Adagrad(_groups(straight), **HYPER), 1.0)
    saved_opt = HybridDeviceOptimizer(torch.optim.Adagrad(_groups(saved_from), **HYPER), 1.0)
    saved_opt.materialize_state()
    for p, q in zip(saved_from, ref):
        assert torch.equal(saved_opt.state[p]["sum"], ref_opt.state[q]["sum"])  # initial_accumulator_value
        assert torch.equal(saved_opt.state[p]["step"], ref_opt.state[q]["step"])
    resumed_opt = HybridDeviceOptimizer(torch.optim.Adagrad(_groups(resumed), **HYPER), 1.0)
    resumed_opt.load_state_dict(copy.deepcopy(saved_opt.state_dict()))
    for opt, params in ((straight_opt, straight), (saved_opt, saved_from), (resumed_opt, resumed), (ref_opt, ref)):
        _run(opt, params, 0, 3)
    _assert_matches(straight_opt, straight, ref_opt, ref)
    _assert_matches(saved_opt, saved_from, ref_opt, ref)
    _assert_matches(resumed_opt, resumed, ref_opt, ref)
    # and a resume mid-run, across torch's Adagrad and the kernel
    cross = HybridDeviceOptimizer(torch.optim.Adagrad(_groups(resumed), **HYPER), 1.0)
    cross.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _run(cross, resumed, 3, 5)
    _run(ref_opt, ref, 3, 5)
    _assert_matches(cross, resumed, ref_opt, ref)


def test_adagrad_is_served_by_its_host_kernel_and_torch_fused_adagrad_too():
    assert offload_fsdp.HostKernel is HostKernel and "register_host_kernel" in offload_fsdp.__all__  # exported
    assert isinstance(host_kernel_for(torch.optim.Adagrad), AdagradKernel)
    ours = _params()
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = HybridDeviceOptimizer(torch.optim.Adagrad(ours, fused=True, **HYPER), 1.0)
    ref_opt = torch.optim.Adagrad(ref, fused=True, **HYPER)
    _run(opt, ours, 0, 3)
    _run(ref_opt, ref, 0, 3)
    _assert_matches(opt, ours, ref_opt, ref)
