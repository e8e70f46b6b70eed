"""load_state_dict runs through torch's own ``Optimizer.load_state_dict``: the user's load hooks run as torch runs them."""

from __future__ import annotations

import copy

import torch

from offload_fsdp import HybridDeviceOptimizer


def _trained(opt_factory):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = opt_factory(params)
    for step in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        opt.step()
    return params, opt


def _hooked(opt, seen: list[str]):
    def pre(optimizer, state_dict):
        seen.append("pre")
        state_dict["param_groups"] = [{**g, "lr": 0.5} for g in state_dict["param_groups"]]  # a top-level edit
        return None

    def returning(optimizer, state_dict):
        seen.append("returning")
        return {**state_dict, "param_groups": [{**g, "weight_decay": 0.25} for g in state_dict["param_groups"]]}

    def post(optimizer):
        exp_avg = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
        seen.append(f"post lr={optimizer.param_groups[0]['lr']} exp_avg={float(exp_avg.sum()):.6f}")

    def first_post(optimizer):
        seen.append("first post")

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_pre_hook(returning)
    opt.register_load_state_dict_post_hook(post)
    opt.register_load_state_dict_post_hook(first_post, prepend=True)


def test_load_hooks_see_edit_and_replace_the_dict_exactly_as_with_torchs_optimizer():
    _, plain = _trained(lambda ps: torch.optim.AdamW(ps, lr=0.01))
    saved = plain.state_dict()
    untouched = copy.deepcopy(saved)
    results = {}
    for name, factory in {
        "torch": lambda ps: torch.optim.AdamW(ps, lr=0.01),
        "offloaded": lambda ps: HybridDeviceOptimizer(ps, 1.0, lr=0.01),
    }.items():
        params, opt = _trained(factory)
        groups = opt.param_groups
        seen: list[str] = []
        _hooked(opt, seen)
        opt.load_state_dict(saved)
        results[name] = (seen, [(g["lr"], g["weight_decay"]) for g in opt.param_groups])
        # torch shallow-copies the dict before the hooks: a hook's top-level edit leaves the caller's dict alone
        assert saved["param_groups"][0]["lr"] == untouched["param_groups"][0]["lr"] == 0.01, name
        if name == "offloaded":
            assert opt.param_groups is groups  # the optimizer's own group list and dicts stay (schedulers hold them)
    assert results["offloaded"] == results["torch"]
    assert results["torch"][0][:3] == ["pre", "returning", "first post"]


def test_a_load_hook_that_raises_leaves_the_optimizer_loadable_and_unchanged():
    params, opt = _trained(lambda ps: HybridDeviceOptimizer(ps, 1.0, lr=0.01))
    before = copy.deepcopy(opt.state_dict())

    def boom(optimizer, state_dict):
        raise RuntimeError("refused by the user's hook")

    handle = opt.register_load_state_dict_pre_hook(boom)
    try:
        opt.load_state_dict(before)
    except RuntimeError as exc:
        assert "refused by the user's hook" in str(exc)
    else:
        raise AssertionError("the hook's error was swallowed")
    handle.remove()
    after = opt.state_dict()
    assert all(torch.equal(before["state"][i]["exp_avg"], after["state"][i]["exp_avg"]) for i in before["state"])
    opt.load_state_dict(before)  # our own hooks were removed with the failed call: a second load works
    assert opt.state_dict()["param_groups"] == before["param_groups"]
