"""State of HybridDeviceOptimizer: state dicts, bit-exact resume, materialisation, master refresh, bf16 moments."""

from __future__ import annotations

import io

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from optim import PrecisionPolicy

SHAPES = [(7, 3), (5,), (4, 4), (0, 2), (6,)]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _grads(step, dtype):
    gen = torch.Generator().manual_seed(500 + step)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _steps(opt, params, start, stop):
    for step in range(start, stop):
        for p, g in zip(params, _grads(step, params[0].dtype)):
            p.grad = g
        opt.step()


def _build(params, fraction, cls=torch.optim.AdamW, **kw):
    kw.setdefault("lr", 0.01)
    if cls is torch.optim.SGD:
        kw.setdefault("momentum", 0.9)
    return HybridDeviceOptimizer(
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}], fraction, cpu_optimizer_cls=cls,
        bucket_numel=20, **kw,
    )  # fmt: skip


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_resume_from_a_weights_only_state_dict_is_bit_exact(dtype, fraction, cls):
    straight = _params(dtype)
    opt = _build(straight, fraction, cls)
    _steps(opt, straight, 0, 6)

    first = _params(dtype)
    opt_a = _build(first, fraction, cls)
    _steps(opt_a, first, 0, 3)
    saved = _roundtrip(opt_a.state_dict())
    weights = [p.detach().clone() for p in first]
    opt_a.param_groups[0]["lr"] = 123.0  # must be overwritten by the load

    resumed = _params(dtype, seed=99)  # different weights: the load + weight copy must fix them
    with torch.no_grad():
        for p, w in zip(resumed, weights):
            p.copy_(w)
    opt_b = _build(resumed, fraction, cls)
    opt_b.reload_model_params()
    opt_b.load_state_dict(saved)
    _steps(opt_b, resumed, 3, 6)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    for p, q in zip(straight, resumed):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key


def test_state_dict_has_torch_layout_and_master_param_only_for_low_precision():
    params = _params(torch.float32)[:3] + [p.detach().to(torch.bfloat16).requires_grad_() for p in _params()[3:]]
    opt = _build(params, 1.0)
    _steps_mixed(opt, params)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3, 4]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert list(sd["state"][0]) == ["step", "exp_avg", "exp_avg_sq"]
    assert list(sd["state"][4]) == ["step", "exp_avg", "exp_avg_sq", "master_param"]
    assert sd["state"][4]["master_param"].dtype == torch.float32
    assert sd["state"][0]["exp_avg"].shape == params[0].shape
    # same keys as plain torch AdamW, so either can load the other's state
    ref = torch.optim.AdamW([p.detach().float().requires_grad_() for p in params])
    _steps_mixed(ref, list(ref.param_groups[0]["params"]))
    assert list(ref.state_dict()["state"][0]) == list(sd["state"][0])


def _steps_mixed(opt, params):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


def test_a_plain_adamw_state_dict_loads_into_the_hybrid_optimizer():
    ref_params, ours = _params(), _params()
    ref = torch.optim.AdamW([{"params": ref_params[:2]}, {"params": ref_params[2:], "lr": 0.003}], lr=0.01)
    _steps(ref, ref_params, 0, 3)
    with torch.no_grad():
        for p, q in zip(ours, ref_params):
            p.copy_(q)
    opt = _build(ours, 0.5)
    opt.reload_model_params()
    opt.load_state_dict(_roundtrip(ref.state_dict()))
    _steps(ref, ref_params, 3, 5)
    _steps(opt, ours, 3, 5)
    for a, b in zip(ours, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_materialize_state_creates_zero_state_and_leaves_params_unchanged(cls, fraction):
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in _params()]
    params[0].grad = torch.ones_like(params[0])  # an existing gradient must survive
    frozen = params.pop()
    frozen.requires_grad_(False)
    before = [p.detach().clone() for p in params + [frozen]]
    opt = _build(params + [frozen], fraction, cls, weight_decay=0.5)
    opt.materialize_state()
    opt.materialize_state()  # idempotent
    for p, b in zip(params + [frozen], before):
        assert torch.equal(p, b)
    assert torch.equal(params[0].grad, torch.ones_like(params[0]))
    ref = cls(
        [q.detach().float().requires_grad_() for q in params],
        lr=0.01,
        **({"momentum": 0.9} if cls is torch.optim.SGD else {}),
    )
    for q in ref.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    ref.step()
    ref_keys = list(ref.state[ref.param_groups[0]["params"][0]])
    for p in params:
        state = opt.state[p]
        assert [k for k in state if k != "master_param"] == ref_keys
        assert all(not v.any() for k, v in state.items() if k != "master_param")
        assert torch.equal(state["master_param"], p.float())
    assert frozen not in opt.state


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_reload_model_params_makes_new_weights_the_truth(fraction):
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in _params()]
    opt = _build(params, fraction, lr=0.0, weight_decay=0.0)
    opt.param_groups[1]["lr"] = 0.0  # a step with lr 0 keeps every weight
    _steps(opt, params, 0, 1)
    masters = [opt.state[p]["master_param"].clone() for p in params]
    new = [torch.full_like(p, 0.5) for p in params]
    with torch.no_grad():
        params[0].copy_(new[0])  # only param 0 is reloaded; the others keep their fp32 masters
    opt.reload_model_params()
    _steps(opt, params, 1, 2)
    assert torch.equal(params[0], new[0])
    assert torch.equal(opt.state[params[0]]["master_param"], new[0].float())
    for p, m in zip(params[1:], masters[1:]):
        assert torch.equal(opt.state[p]["master_param"], m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_written_before_the_first_step_or_between_steps_are_kept(dtype):
    params = _params(dtype)
    opt = _build(params, 1.0, lr=0.0, weight_decay=0.0)
    opt.param_groups[1]["lr"] = 0.0
    with torch.no_grad():
        params[0].fill_(0.5)  # e.g. model.load_state_dict right after building the optimizer
    _steps(opt, params, 0, 1)
    assert torch.equal(params[0], torch.full_like(params[0], 0.5)), "the first step refreshes the masters"
    with torch.no_grad():
        params[0].fill_(0.25)
    _steps(opt, params, 1, 2)
    assert torch.equal(params[0], torch.full_like(params[0], 0.25)), "a write between steps is seen by itself"
    with torch.no_grad():
        params[0].fill_(0.125)
    opt.reload_model_params()  # the explicit form still works
    _steps(opt, params, 2, 3)
    assert torch.equal(params[0], torch.full_like(params[0], 0.125))


def test_bf16_moments_halve_host_state_and_track_fp32_moments():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=gen).requires_grad_()
    ours = ref.detach().clone().requires_grad_()
    policy = PrecisionPolicy(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    opt = HybridDeviceOptimizer([ours], 1.0, lr=1e-3, precision=policy)
    fp32 = HybridDeviceOptimizer([ref], 1.0, lr=1e-3)
    for step in range(100):
        g = torch.randn(4096, generator=gen) * (1.0 if step < 20 else 1e-2)  # grads shrink: v must decay
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        fp32.step()
    state, ref_state = opt.state[ours], fp32.state[ref]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert dict(opt.layout().buckets[0].state_dtypes)["exp_avg"] == torch.bfloat16
    v, v_ref = state["exp_avg_sq"].float(), ref_state["exp_avg_sq"]
    assert ((v - v_ref).abs() / v_ref).mean() < 0.02  # round-to-nearest would stall the decay (~10x worse)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_moments_resume_bit_exact_through_torch_save(dtype):
    # bf16 params: fp32 masters and bf16 moments are both in the state dict, and
    # torch.save refuses views of one storage in two dtypes.
    policy = PrecisionPolicy(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    a, b = _params(dtype), _params(dtype)
    opt_a = _build(a, 1.0, precision=policy)
    _steps(opt_a, a, 0, 5)
    opt_b = _build(b, 1.0, precision=policy)
    _steps(opt_b, b, 0, 2)
    saved = _roundtrip(opt_b.state_dict())
    c = [p.detach().clone().requires_grad_() for p in b]
    opt_c = _build(c, 1.0, precision=policy)
    opt_c.load_state_dict(saved)
    assert opt_c.state[c[0]]["exp_avg"].dtype == torch.bfloat16
    _steps(opt_c, c, 2, 5)
    for x, y in zip(a, c):
        assert torch.equal(x, y)


def test_load_state_dict_forgets_state_of_params_absent_from_the_saved_state():
    a = _params()
    opt = _build(a, 1.0)
    _steps(opt, a, 0, 1)
    sd = opt.state_dict()
    del sd["state"][1]
    opt.load_state_dict(sd)
    assert a[1] not in opt.state and a[0] in opt.state


@pytest.mark.parametrize(
    "dtype, policy",
    [(torch.float32, PrecisionPolicy()), (torch.bfloat16, PrecisionPolicy()),
     (torch.bfloat16, PrecisionPolicy(main_grads_dtype=torch.float32, exp_avg_dtype=torch.bfloat16))],
)  # fmt: skip
def test_torch_save_of_the_state_dict_writes_the_state_and_not_the_grad_staging_beside_it(dtype, policy):
    """State tensors are views of host arenas and torch.save writes a view's whole storage."""
    params = [torch.randn(n).to(dtype).requires_grad_() for n in (1 << 16, 3000)]
    opt = HybridDeviceOptimizer(torch.optim.AdamW(params, lr=0.01), 1.0, precision=policy)
    for p in params:
        if policy.main_grads_dtype is not None:
            p.decoupled_grad = torch.randn(p.shape)
        else:
            p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state_dict()
    tensor_bytes = sum(
        t.numel() * t.element_size() for s in state["state"].values() for t in s.values() if torch.is_tensor(t)
    )
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert tensor_bytes <= buffer.tell() < tensor_bytes + (64 << 10)  # pickle and archive overhead only


@pytest.mark.parametrize("cls", [torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adagrad])
@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_training_after_materialize_state_matches_torch_for_classes_whose_fresh_state_is_not_zero(cls, fraction):
    ours, ref_params = _params(), _params()
    kw = {"lr": 0.01, **({"initial_accumulator_value": 0.5} if cls is torch.optim.Adagrad else {})}
    opt = HybridDeviceOptimizer(cls(ours, **kw), fraction, bucket_numel=16)
    opt.materialize_state()  # zeros to load into; Rprop's step sizes and ASGD's eta start at lr in torch
    ref = cls(ref_params, **kw)
    _steps(opt, ours, 0, 3)
    _steps(ref, ref_params, 0, 3)
    for a, b in zip(ours, ref_params):
        assert torch.equal(a, b)


def test_state_loaded_after_materialize_state_is_kept_by_the_next_step():
    ours, ref_params = _params(), _params()
    ref = torch.optim.Rprop(ref_params, lr=0.01)
    _steps(ref, ref_params, 0, 2)
    with torch.no_grad():
        for p, q in zip(ours, ref_params):
            p.copy_(q)
    opt = HybridDeviceOptimizer(torch.optim.Rprop(ours, lr=0.01), 0.5, bucket_numel=16)
    opt.materialize_state()
    opt.load_state_dict(_roundtrip(ref.state_dict()))
    _steps(opt, ours, 2, 4)
    _steps(ref, ref_params, 2, 4)
    for a, b in zip(ours, ref_params):
        assert torch.equal(a, b)
