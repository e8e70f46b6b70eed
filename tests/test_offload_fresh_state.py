"""offload_fsdp.fresh_state: an optimizer's empty state is what its first step creates before updating."""

import pytest
import torch

import checkpoint
from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.fresh_state import create_fresh_state, materialize_state

CLASSES = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "Rprop": (torch.optim.Rprop, {"lr": 0.01}),
    "ASGD": (torch.optim.ASGD, {"lr": 0.01}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.01, "initial_accumulator_value": 0.5}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=gen)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _step_counters(opt: torch.optim.Optimizer) -> list[float]:
    return [float(s["step"]) for s in opt.state.values() if "step" in s]


def test_the_init_group_hook_fresh_state_relies_on_exists_in_torch():
    # Private torch API (offload_fsdp/fresh_state.py says why): a torch upgrade that drops it fails here.
    for cls, _ in CLASSES.values():
        assert callable(cls._init_group), cls.__name__


@pytest.mark.parametrize("name", list(CLASSES))
def test_materialise_then_checkpoint_load_then_step_equals_plain_resume_bit_for_bit(name, tmp_path):
    cls, kw = CLASSES[name]
    model = _model(0)
    opt = cls(model.parameters(), **kw)
    _train(model, opt, 3, seed=1)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)

    plain_model = _model(0)  # torch's plain resume: load_state_dict into a fresh optimizer
    plain = cls(plain_model.parameters(), **kw)
    plain_model.load_state_dict(model.state_dict())
    plain.load_state_dict(opt.state_dict())

    ours_model = _model(7)
    ours = cls(ours_model.parameters(), **kw)
    materialize_state(ours)
    checkpoint.load(tmp_path / "c", model=ours_model, optimizer=ours)

    _train(plain_model, plain, 2, seed=2)
    _train(ours_model, ours, 2, seed=2)
    for (fqn, a), b in zip(plain_model.named_parameters(), ours_model.parameters()):
        assert torch.equal(a, b), fqn
    assert _step_counters(plain) == _step_counters(ours)


@pytest.mark.parametrize("name", list(CLASSES))
def test_materialising_changes_no_parameter_and_its_next_step_is_torchs_first_step(name):
    cls, kw = CLASSES[name]
    model, ref_model = _model(0), _model(0)
    opt, ref = cls(model.parameters(), **kw), cls(ref_model.parameters(), **kw)
    params = list(model.parameters())
    params[0].grad = torch.ones_like(params[0])  # a gradient of the user's must survive
    before = [p.detach().clone() for p in params]

    created = materialize_state(opt)

    assert created == {id(p) for p in params} or name == "Adagrad"  # Adagrad's state exists from __init__
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert torch.equal(params[0].grad, torch.ones_like(params[0])) and params[1].grad is None
    assert all(opt.state[p] for p in params)
    assert set(_step_counters(opt)) <= {0.0}  # no update ran: a fresh state's counter
    opt.zero_grad()
    _train(model, opt, 2, seed=3)  # stepped from the materialised state without a load
    _train(ref_model, ref, 2, seed=3)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_rprop_step_sizes_start_at_lr_and_asgd_eta_at_lr():
    p = torch.nn.Parameter(torch.randn(4))
    rprop, asgd = torch.optim.Rprop([p], lr=0.25), torch.optim.ASGD([torch.nn.Parameter(torch.randn(4))], lr=0.25)
    materialize_state(rprop)
    materialize_state(asgd)
    assert torch.equal(rprop.state[p]["step_size"], torch.full((4,), 0.25))
    assert float(rprop.state[p]["step"]) == 0.0 and not rprop.state[p]["prev"].any()
    (asgd_state,) = asgd.state.values()
    assert float(asgd_state["eta"]) == 0.25 and float(asgd_state["step"]) == 0.0


class _OwnSGD(torch.optim.SGD):
    """A class outside torch.optim: its _init_group is not trusted, the throw-away step is used."""


def test_a_class_outside_torch_gets_zero_filled_state_from_a_throwaway_step_that_touches_nothing():
    model = _model(0)
    opt = _OwnSGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps opt.step: must not run
    seen = []
    opt.register_step_post_hook(lambda *a: seen.append(a))
    before = [p.detach().clone() for p in model.parameters()]
    materialize_state(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        assert opt.state[p]["momentum_buffer"].shape == p.shape and not opt.state[p]["momentum_buffer"].any()
    assert seen == [] and opt.param_groups[0]["lr"] == 0.5 and sched.last_epoch == 0


def test_create_fresh_state_leaves_existing_state_and_other_params_alone():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([a, b], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()
    a_state = {k: v.clone() for k, v in opt.state[a].items()}
    create_fresh_state(opt, [a])
    assert not opt.state.get(b)
    assert all(torch.equal(opt.state[a][k], v) for k, v in a_state.items())
    create_fresh_state(opt, [b])
    assert float(opt.state[b]["step"]) == 0.0 and not opt.state[b]["exp_avg"].any()


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_hybrid_optimizer_materialises_the_class_fresh_state_through_the_same_function(fraction):
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    opt = HybridDeviceOptimizer(torch.optim.Rprop(params, lr=0.25), fraction, bucket_numel=8)
    assert materialize_state(opt) == {id(p) for p in params}
    for p in params:
        assert torch.equal(opt.state[p]["step_size"], torch.full((5,), 0.25))
        assert float(opt.state[p]["step"]) == 0.0
