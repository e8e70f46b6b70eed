"""HybridDeviceOptimizer.add_param_group after construction: parity, resume, coverage, errors, FSDP2."""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from tests.distributed import run_ranks
from tests.test_offload_state import SHAPES, _grads, _params, _roundtrip

FIRST = 2  # params[:FIRST] at construction, params[FIRST:] added later as group 1
ADD_AT = 2  # the group is added before this step
CONFIGS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
}
ADDED_HYPER = {"lr": 0.003, "weight_decay": 0.0}


def _add_group(opt, params):
    opt.add_param_group({"params": params[FIRST:], **ADDED_HYPER})


def _steps(opt, params, start, stop):
    """Every param gets a grad each step; before ADD_AT only group 0 is optimised (as in torch)."""
    for step in range(start, stop):
        if step == ADD_AT:
            _add_group(opt, params)
        for p, g in zip(params, _grads(step, torch.bfloat16)):
            p.grad = g.to(p.dtype)  # bf16 values, so the fp32 reference sees exactly the same grads
        opt.step()


def _build(params, fraction, cls=torch.optim.AdamW, **kw):
    return HybridDeviceOptimizer(params[:FIRST], fraction, cpu_optimizer_cls=cls, bucket_numel=20, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_group_added_after_some_steps_matches_the_plain_optimizer(name, fraction, dtype):
    cls, kw = CONFIGS[name]
    ours = _params(dtype)
    ref = [p.detach().float().requires_grad_() for p in ours]  # bf16: the fp32 masters start as the upcast
    opt = _build(ours, fraction, cls, **kw)
    _steps(opt, ours, 0, 5)
    _steps(cls(ref[:FIRST], **kw), ref, 0, 5)
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == ADDED_HYPER["lr"]
    for i, (a, b) in enumerate(zip(ours, ref)):
        master = opt.state[a]["master_param"] if dtype != torch.float32 and a.numel() else a
        torch.testing.assert_close(master.float(), b, rtol=1e-5, atol=1e-6, msg=f"param {i}")
        assert torch.equal(a, master.to(dtype)), "the param is the cast of its master"


def test_the_added_group_is_partitioned_by_the_fraction_of_its_own_elements():
    params = [torch.zeros(n, requires_grad=True) for n in (10, 10, 10, 10, 10, 30)]
    opt = HybridDeviceOptimizer(params[:2], 0.5, lr=0.1)
    opt.add_param_group({"params": params[2:]})  # 60 elements: the prefix whose midpoints lie in the first 30
    layout = opt.layout()
    assert layout.offloaded == (True, False, True, True, True, False)
    assert [b.index for b in layout.buckets] == list(range(len(layout.buckets)))
    assert {b.group_index for b in layout.buckets} == {0, 1}


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_resume_of_an_optimizer_with_an_added_group_is_bit_exact(fraction):
    straight = _params(torch.bfloat16)
    opt = _build(straight, fraction)
    _steps(opt, straight, 0, 6)

    first = _params(torch.bfloat16)
    opt_a = _build(first, fraction)
    _steps(opt_a, first, 0, 4)
    saved = _roundtrip(opt_a.state_dict())
    assert [g["params"] for g in saved["param_groups"]] == [list(range(FIRST)), list(range(FIRST, len(SHAPES)))]

    resumed = _params(torch.bfloat16, seed=99)
    with torch.no_grad():
        for p, q in zip(resumed, first):
            p.copy_(q)
    opt_b = _build(resumed, fraction)
    _add_group(opt_b, resumed)  # torch convention: the resumed optimizer has the same groups
    opt_b.param_groups[1]["lr"] = 123.0  # must be overwritten by the load
    opt_b.load_state_dict(saved)
    _steps(opt_b, resumed, 4, 6)
    for i, (a, b) in enumerate(zip(straight, resumed)):
        assert torch.equal(a, b), i
        for key, value in opt.state[a].items():
            assert torch.equal(value, opt_b.state[b][key]), (i, key)


def test_adding_a_parameter_that_is_already_optimised_raises_naming_it():
    params = _params()
    named = [(f"layer{i}.weight", p) for i, p in enumerate(params)]
    opt = HybridDeviceOptimizer(named[:FIRST], 1.0, lr=0.01)
    with pytest.raises(ValueError, match=r"'layer1.weight'.*already in param group 0"):
        opt.add_param_group({"params": [named[2], named[1]]})
    with pytest.warns(UserWarning, match="duplicate"), pytest.raises(ValueError, match="'layer2.weight' twice"):
        opt.add_param_group({"params": [named[2], named[2]]})
    with pytest.raises(ValueError, match="'late.weight' is on the meta device"):  # construction's checks apply
        opt.add_param_group({"params": [named[2], ("late.weight", torch.empty(3, device="meta", requires_grad=True))]})
    assert len(opt.param_groups) == 1 and len(opt.layout().params) == FIRST, "a refused group leaves no trace"
    opt.add_param_group({"params": named[FIRST:]})
    with pytest.raises(ValueError, match=r"'layer4.weight'.*already in param group 1"):
        opt.add_param_group({"params": [named[4]]})


def test_materialize_zero_grad_and_reload_cover_the_added_group():
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in _params()]
    opt = HybridDeviceOptimizer(params[:FIRST], 0.5, lr=0.0, weight_decay=0.0, bucket_numel=20)
    opt.add_param_group({"params": params[FIRST:]})
    added = [p for p in params[FIRST:] if p.numel()]
    before = [p.detach().clone() for p in params]
    opt.materialize_state()
    assert all(opt.state[p]["step"] == 0 and not opt.state[p]["exp_avg"].any() for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))

    for p in params:
        p.decoupled_grad = torch.ones(p.shape)  # fp32 grads of bf16 params live in decoupled_grad
    opt.zero_grad(set_to_none=False)
    assert all(p.decoupled_grad is not None and not p.decoupled_grad.any() for p in added)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in params)

    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # lr 0; the first step refreshes masters by itself (reload_model_params is the explicit form)
    with torch.no_grad():
        for p in added:
            p.fill_(0.5)
    opt.reload_model_params()
    opt.step()
    for p in added:
        assert torch.equal(p, torch.full_like(p, 0.5)), "a stale master reverted the new weights"
        assert torch.equal(opt.state[p]["master_param"], torch.full(p.shape, 0.5))


def test_adding_a_group_logs_its_partition_and_leaves_existing_buffers_in_place(caplog):
    params = _params()
    opt = _build(params, 1.0, lr=0.01)
    _steps(opt, params, 0, 1)
    first = [p for p in opt.param_groups[0]["params"]]
    views = [tuple(t.data_ptr() for t in opt.state[p].values() if t.dim()) for p in first]  # moments (+ master)
    arenas = opt.layout().arenas
    with caplog.at_level("INFO", logger="offload_fsdp.optimizer"):
        _add_group(opt, params)
    messages = [r.getMessage() for r in caplog.records if "partition" in r.getMessage()]
    added = sum(p.numel() for p in params[FIRST:])
    assert len(messages) == 1 and "param group 1 added" in messages[0]
    assert f"host {len(params) - FIRST} params / {added} elements / {4 * added} bytes" in messages[0]
    _steps(opt, params, ADD_AT + 1, ADD_AT + 3)
    after = [tuple(t.data_ptr() for t in opt.state[p].values() if t.dim()) for p in first]
    assert after == views
    assert opt.layout().arenas[: len(arenas)] == arenas  # construction's arenas, unchanged


def _fsdp_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)
        )
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def train(model, opt, start, stop):
        for step in range(start, stop):
            if step == ADD_AT:  # progressive unfreezing: the last two layers join later, with their own lr
                opt.add_param_group({"params": list(model[2].parameters()) + list(model[4].parameters()), "lr": 0.003})
            gen = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(4, 6, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    ref = sharded()
    train(ref, torch.optim.AdamW(ref[0].parameters(), lr=0.01), 0, 4)
    out = {}
    for fraction in (0.5, 1.0):
        model = sharded()
        opt = HybridDeviceOptimizer(torch.optim.AdamW(model[0].parameters(), lr=0.01), fraction)
        train(model, opt, 0, 4)
        out[fraction] = max(
            (a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())
        )
        out[f"offloaded_{fraction}"] = list(opt.layout().offloaded)
    return out


@pytest.mark.slow
def test_fsdp2_group_added_after_some_steps_matches_plain_adamw_on_two_ranks():
    for rank, out in enumerate(run_ranks(_fsdp_body, 2)):
        for fraction in (0.5, 1.0):
            assert out[fraction] < 1e-5, (rank, fraction, out)
        assert out["offloaded_1.0"] == [True] * 6 and len(set(out["offloaded_0.5"][2:])) == 2, (rank, out)
