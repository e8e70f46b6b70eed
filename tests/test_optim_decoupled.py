"""Decoupled gradients end to end: clipping and the torch backend step bf16 params from fp32 decoupled grads.

torch.optim reads ``.grad`` and updates a param in its own dtype, so
``build_optimizer(backend="torch")`` steps fp32 main copies through optimizer
hooks (optim.main_params). The reference is plain fused AdamW on fp32 copies
of the params with the fp32 gradients in ``.grad``, clipped by torch.
"""

from __future__ import annotations

import pytest
import torch

from optim import PrecisionPolicy, build_optimizer, clip_grad_norm_, get_grad, set_grad, zero_grad

BF16 = torch.bfloat16


def _grads(step: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) * (1 + step % 3) for s in shapes]


def _pair(shapes: list[tuple[int, ...]]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    bf16 = [torch.nn.Parameter(t.to(BF16)) for t in init]
    ref = [torch.nn.Parameter(p.detach().float()) for p in bf16]  # the exact upcast, as the main copy starts
    return bf16, ref


def _run(params, ref, steps, opt=None, ref_opt=None, start=0):
    shapes = [tuple(p.shape) for p in params]
    opt = opt or build_optimizer(params, "adamw", precision=PrecisionPolicy(), lr=1e-2, weight_decay=0.1)
    ref_opt = ref_opt or torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    for step in range(start, start + steps):
        grads = _grads(step, shapes)
        for p, r, g in zip(params, ref, grads):
            set_grad(p, g.clone())  # fp32 grad of a bf16 param -> decoupled_grad
            r.grad = g.clone()
        norm = clip_grad_norm_(params, max_norm=1.0)
        ref_norm = torch.nn.utils.get_total_norm([r.grad for r in ref])
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        # Same norm -> same coefficient -> the fp32 trajectories can be compared bit for bit.
        torch.nn.utils.clip_grads_with_norm_(ref, 1.0, norm)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        zero_grad(params)
        ref_opt.zero_grad()
    return opt, ref_opt


def test_torch_backend_steps_bf16_params_from_fp32_decoupled_grads_like_fp32_adamw():
    shapes = [(7, 3), (5,), (0, 4)]  # an empty shard included
    params, ref = _pair(shapes)
    opt, _ = _run(params, ref, steps=6)
    for p, r in zip(params, ref):
        assert p.dtype == BF16 and p.grad is None and getattr(p, "decoupled_grad", None) is None
        # The fp32 main copy follows fp32 AdamW exactly; the bf16 param is its rounding.
        assert torch.equal(opt.state[p]["master_param"], r.detach())
        assert torch.equal(p.detach(), r.detach().to(BF16))
        assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_torch_backend_resume_from_state_dict_keeps_fp32_main_params_and_moments():
    shapes = [(6, 2), (3,)]
    params, ref = _pair(shapes)
    opt, ref_opt = _run(params, ref, steps=3)
    saved = opt.state_dict()
    # A fresh optimizer over the same (bf16) params: torch would cast loaded state to bf16.
    fresh = build_optimizer(params, "adamw", lr=1e-2, weight_decay=0.1)
    fresh.load_state_dict(saved)
    for p in params:
        assert fresh.state[p]["master_param"].dtype == torch.float32
        assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    _run(params, ref, steps=2, opt=fresh, ref_opt=ref_opt, start=3)
    for p, r in zip(params, ref):
        assert torch.equal(fresh.state[p]["master_param"], r.detach())


def test_fp32_param_with_fp32_decoupled_grad_is_stepped_and_grad_slot_restored():
    p = torch.nn.Parameter(torch.ones(4))
    r = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer([p], "sgd", lr=0.5)
    g = torch.arange(4.0)
    p.decoupled_grad = g
    r.grad = g.clone()
    opt.step()
    torch.optim.SGD([r], lr=0.5).step()
    assert torch.equal(p.detach(), r.detach())
    assert p.grad is None and get_grad(p) is g


def test_zero_grad_clears_both_slots_or_zeroes_them_in_place():
    p = torch.nn.Parameter(torch.zeros(3, dtype=BF16))
    g = torch.ones(3)
    set_grad(p, g)
    zero_grad([p], set_to_none=False)
    assert p.decoupled_grad is g and torch.equal(g, torch.zeros(3))
    zero_grad([p])
    assert get_grad(p) is None


def test_zero_grad_in_place_zeroes_every_buffer_of_both_slots_across_dtypes_and_keeps_each():
    params = [
        torch.nn.Parameter(torch.zeros(n, dtype=d)) for n, d in ((3, BF16), (5, torch.float32), (2, torch.float64))
    ]
    kept = []
    for p in params:
        p.grad = torch.full_like(p, 2.0)
        p.decoupled_grad = torch.full(p.shape, 3.0)
        kept.append((p.grad, p.decoupled_grad))
    zero_grad(params, set_to_none=False)
    for p, (grad, decoupled) in zip(params, kept):
        assert p.grad is grad and p.decoupled_grad is decoupled
        assert not grad.any() and not decoupled.any()


def test_zero_grad_of_the_built_torch_optimizer_clears_decoupled_grads_too():
    params, _ = _pair([(4, 2), (3,)])
    opt = build_optimizer(params, "adamw", lr=0.1)
    assert type(opt) is torch.optim.AdamW  # still the user's class, not a wrapper
    grads = _grads(0, [tuple(p.shape) for p in params])
    for p, g in zip(params, grads):
        set_grad(p, g)  # fp32 grads of bf16 params: decoupled_grad
    opt.zero_grad(set_to_none=False)
    assert all(p.decoupled_grad is g and not g.any() for p, g in zip(params, grads))  # zeroed in place
    opt.zero_grad()
    assert all(get_grad(p) is None for p in params)


def test_fp64_params_are_never_stepped_through_a_narrower_fp32_main_copy():
    p = torch.nn.Parameter(torch.full((3,), 1.0 + 1e-12, dtype=torch.float64))
    r = torch.nn.Parameter(p.detach().clone())
    opt = build_optimizer([p], "sgd", lr=1e-13)
    p.grad, r.grad = torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    opt.step()
    torch.optim.SGD([r], lr=1e-13).step()
    assert torch.equal(p.detach(), r.detach()) and "master_param" not in opt.state[p]


@pytest.mark.filterwarnings("ignore:Using backward:UserWarning")  # create_graph=True: a known cycle
def test_zero_grad_in_place_detaches_a_grad_built_with_create_graph_as_torch_does():
    p = torch.nn.Parameter(torch.ones(3))
    (p * p).sum().backward(create_graph=True)
    assert p.grad.grad_fn is not None
    kept = p.grad
    zero_grad([p], set_to_none=False)
    assert p.grad is kept and p.grad.grad_fn is None and not p.grad.requires_grad and not p.grad.any()
