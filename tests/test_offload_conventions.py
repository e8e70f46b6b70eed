"""torch's optimizer conventions hold for HybridDeviceOptimizer: schedulers, frozen params, loads, duplicates."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from tests.distributed import run_ranks


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in ((4, 3), (5,), (3, 3))]


def _set_grads(params_lists: list[list[torch.Tensor]], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for params in zip(*params_lists):
        g = torch.randn(params[0].shape, generator=gen)
        for p in params:
            p.grad = g.clone()


_SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s),
    # OneCycleLR also cycles Adam's betas[0] (cycle_momentum)
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10),
}


@pytest.mark.parametrize("kind", sorted(_SCHEDULERS))
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_scheduler_attached_before_wrapping_drives_the_real_hyperparameters(kind, fraction):
    ours, ref = _params(), _params()
    inner = torch.optim.AdamW(ours, lr=0.01, weight_decay=0.1)
    sched = _SCHEDULERS[kind](inner)  # attached to the inner optimizer, then wrapped
    opt = HybridDeviceOptimizer(inner, fraction)
    ref_opt = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1)
    ref_sched = _SCHEDULERS[kind](ref_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # incl. "lr_scheduler.step() before optimizer.step()"
        for step in range(6):
            _set_grads([ours, ref], step)
            opt.step()
            ref_opt.step()
            sched.step()
            ref_sched.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_group_added_through_the_wrapper_is_driven_by_a_scheduler_built_on_the_wrapped_optimizer(fraction):
    ours, ref = _params(), _params()
    inner = torch.optim.AdamW([{"params": ours[:1], "lr": 0.02}, {"params": ours[1:2]}], lr=0.01, fused=True)
    opt = HybridDeviceOptimizer(inner, fraction)
    opt.add_param_group({"params": ours[2:], "lr": 0.05})
    ref_opt = torch.optim.AdamW([{"params": ref[:1], "lr": 0.02}, {"params": ref[1:2]}], lr=0.01, fused=True)
    ref_opt.add_param_group({"params": ref[2:], "lr": 0.05})
    lambdas = [lambda s: 0.5**s, lambda s: 0.9**s, lambda s: 1.0 / (s + 1)]
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambdas)  # the user's handle: the wrapped optimizer
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambdas)
    for step in range(4):
        _set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_stepping_the_wrapped_optimizer_itself_is_refused_and_changes_nothing():
    params = _params()
    inner = torch.optim.AdamW(params, lr=0.01)
    opt = HybridDeviceOptimizer(inner, 0.5)
    _set_grads([params], 0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"this AdamW is wrapped by a HybridDeviceOptimizer.*call step\(\) on the"):
        inner.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not inner.state
    opt.step()  # the wrapper itself still steps


class _ReadOnlyGroups(torch.optim.SGD):
    """An optimizer whose param_groups cannot be replaced once set (as some optimizer wrappers do)."""

    @property
    def param_groups(self):
        return self.__dict__["_groups"]

    @param_groups.setter
    def param_groups(self, value):
        if "_groups" in self.__dict__:
            raise AttributeError("param_groups is read-only")
        self.__dict__["_groups"] = value


def test_wrapping_an_optimizer_whose_groups_cannot_be_taken_over_is_refused_with_the_way_out():
    inner = _ReadOnlyGroups(_params(), lr=0.1)
    with pytest.raises(TypeError, match=r"cannot take over the param groups of _ReadOnlyGroups.*cpu_optimizer_cls="):
        HybridDeviceOptimizer(inner, 1.0)


def test_a_group_added_to_the_wrapped_optimizer_after_wrapping_is_refused_at_step():
    params = _params()
    inner = torch.optim.AdamW(params[:2], lr=0.01)
    opt = HybridDeviceOptimizer(inner, 1.0)
    inner.add_param_group({"params": params[2:]})  # behind the wrapper's back: no update space exists
    _set_grads([params], 0)
    with pytest.raises(ValueError, match=r"param group 1 was added to the wrapped AdamW.*add_param_group on the "
                                         r"HybridDeviceOptimizer"):  # fmt: skip
        opt.step()


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_param_frozen_at_construction_and_unfrozen_later_is_refused_by_name(fraction):
    params = _params()
    params[0].requires_grad_(False)
    opt = HybridDeviceOptimizer([("embed.weight", params[0]), ("a", params[1]), ("b", params[2])], fraction, lr=0.01)
    params[0].requires_grad_(True)  # progressive unfreezing
    _set_grads([params], 0)
    with pytest.raises(ValueError, match=r"'embed.weight' has a gradient but requires_grad was False when the "
                                         r"optimizer was built.*build the optimizer after unfreezing it"):  # fmt: skip
        opt.step()


def test_a_param_listed_twice_in_one_group_is_refused_at_construction():
    p, q = _params()[:2]
    with (
        pytest.warns(UserWarning, match="duplicate"),
        pytest.raises(ValueError, match=r"param group 0 lists parameter .*\[2\]. twice \(positions 0 and 2\)"),
    ):
        HybridDeviceOptimizer([p, q, p], 1.0, lr=0.01)
    with pytest.warns(UserWarning, match="duplicate"), pytest.raises(ValueError, match="twice"):
        HybridDeviceOptimizer(torch.optim.SGD([{"params": [q]}, {"params": [p, p]}], lr=0.1), 0.5)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_failed_load_changes_nothing(fraction):
    params = _params()
    opt = HybridDeviceOptimizer(params, fraction, lr=0.01)
    _set_grads([params], 0)
    opt.step()
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    for state in bad["state"].values():
        state["exp_avg"] = state["exp_avg"] + 1  # every param's values change...
        state["step"] = state["step"] + 5
    bad["state"][1]["exp_avg"] = torch.zeros(7)  # ...but param 1's exp_avg has the wrong shape
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter .*\[1\].*local shape \(7,\)"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for i, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][i][key], value), (i, key)


def test_a_failed_load_into_a_fresh_optimizer_creates_no_state():
    params = _params()
    opt = HybridDeviceOptimizer(params, 0.5, lr=0.01)
    _set_grads([params], 0)
    opt.step()
    bad = copy.deepcopy(opt.state_dict())
    del bad["state"][2]["exp_avg_sq"]
    fresh = HybridDeviceOptimizer(_params(), 0.5, lr=0.01)
    with pytest.raises(ValueError, match="keys"):
        fresh.load_state_dict(bad)
    assert not fresh.state_dict()["state"]


def _fsdp_state_dict_body(rank: int, world_size: int) -> list[bool]:
    return [_fsdp_state_dict_case(world_size, fraction, dtype)
            for fraction in (0.5, 1.0) for dtype in (torch.float32, torch.bfloat16)]  # fmt: skip


def _fsdp_state_dict_case(world_size: int, fraction: float, dtype: torch.dtype) -> bool:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(dtype)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), fraction)
    model(torch.randn(2, 6, dtype=dtype)).float().sum().backward()
    opt.step()
    sd = opt.state_dict()
    for candidate in (sd, get_state_dict(model, opt)[1]):
        buffer = io.BytesIO()
        torch.save(candidate, buffer)
        copy.deepcopy(candidate)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), fraction)
    fresh.load_state_dict(copy.deepcopy(sd))
    return all(
        torch.equal(a[k].to_local() if hasattr(a[k], "to_local") else a[k],
                    b[k].to_local() if hasattr(b[k], "to_local") else b[k])
        for a, b in zip(fresh.state_dict()["state"].values(), sd["state"].values()) for k in a
    ) and len(loaded["state"]) == len(sd["state"])  # fmt: skip


def test_fsdp2_state_dict_survives_save_deepcopy_and_weights_only_load():
    for results in run_ranks(_fsdp_state_dict_body, world_size=2):
        assert all(results), results  # fp32 / bf16 params at offload_fraction 0.5 and 1
