"""HybridDeviceOptimizer matches plain torch optimizers on CPU, whatever share is offloaded."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.copy_engine import SyncCopyEngine

SHAPES = [(7, 3), (5,), (4, 4), (0, 3), (6,)]  # includes an empty tensor
CONFIGS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)),
}


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    # two groups with different hyper-parameters; the second overrides lr and weight decay
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.002, "weight_decay": 0.0}]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _run(opt, params, steps, dtype, sched=None):
    for step in range(steps):
        for p, g in zip(params, _grads(step, dtype)):
            p.grad = g.to(p.dtype)  # bf16 values; the fp32 reference sees them upcast
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("steps", [1, 10])
def test_fp32_params_match_the_plain_optimizer(name, fraction, steps):
    cls, kw = CONFIGS[name]
    ours, ref = _params(), _params()
    opt = HybridDeviceOptimizer(_groups(ours), fraction, cpu_optimizer_cls=cls, bucket_numel=24, **kw)
    _run(opt, ours, steps, torch.float32)
    _run(cls(_groups(ref), **kw), ref, steps, torch.float32)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_bf16_params_follow_an_fp32_master_reference(name, fraction):
    cls, kw = CONFIGS[name]
    ours = _params(torch.bfloat16)
    ref = [p.detach().float().requires_grad_() for p in ours]  # the master starts as the exact upcast
    opt = HybridDeviceOptimizer(_groups(ours), fraction, cpu_optimizer_cls=cls, bucket_numel=24, **kw)
    _run(opt, ours, 10, torch.bfloat16)
    _run(cls(_groups(ref), **kw), ref, 10, torch.bfloat16)  # grads are the same bf16 values, upcast
    for a, b in zip(ours, ref):
        master = opt.state[a]["master_param"]
        torch.testing.assert_close(master, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(a, master.to(torch.bfloat16)), "the bf16 param must be the cast of its master"


def test_partition_offloads_a_deterministic_whole_parameter_prefix():
    params = [torch.zeros(n, requires_grad=True) for n in (10, 10, 10, 10)]
    for fraction, expected in [(0.0, 0), (0.25, 1), (0.5, 2), (0.6, 2), (1.0, 4)]:
        opt = HybridDeviceOptimizer(params, fraction, lr=0.1)
        assert opt.layout().offloaded == tuple(i < expected for i in range(4)), fraction


def test_lr_betas_and_weight_decay_changes_take_effect_on_the_next_step():
    ours, ref = _params(), _params()
    opt = HybridDeviceOptimizer(_groups(ours), 1.0, lr=0.01)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.01)
    for step in range(4):
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = 0.01 * (step + 1)
            o.param_groups[0]["betas"] = (0.9 - 0.1 * step, 0.99)
            o.param_groups[1]["weight_decay"] = 0.05 * step
        for p, q, g in zip(ours, ref, _grads(step, torch.float32)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _schedulers(opt):
    sched = torch.optim.lr_scheduler
    return {
        "lambda": lambda: sched.LambdaLR(opt, lambda s: 0.9**s),
        "cosine": lambda: sched.CosineAnnealingLR(opt, T_max=5),
        "sequential": lambda: sched.SequentialLR(
            opt, [sched.LinearLR(opt, 0.1, total_iters=3), sched.ExponentialLR(opt, 0.8)], milestones=[3]
        ),
        # reads the optimizer's defaults["lr"], as some schedulers in the wild do
        "from_defaults": lambda: sched.LambdaLR(opt, lambda s: 1.0 / (1 + s * opt.defaults["lr"] * 100)),
    }


@pytest.mark.parametrize("kind", ["lambda", "cosine", "sequential", "from_defaults"])
def test_lr_schedulers_drive_the_host_update_like_the_plain_optimizer(kind):
    ours, ref = _params(), _params()
    opt = HybridDeviceOptimizer(_groups(ours), 0.5, lr=0.01, bucket_numel=24)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.01)
    _run(opt, ours, 8, torch.float32, _schedulers(opt)[kind]())
    _run(ref_opt, ref, 8, torch.float32, _schedulers(ref_opt)[kind]())
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tensor_lr_stays_a_tensor_and_updates_like_a_float():
    ours, ref = _params(), _params()
    opt = HybridDeviceOptimizer(ours, 1.0, lr=torch.tensor(0.01))
    _run(opt, ours, 3, torch.float32)
    _run(torch.optim.AdamW(ref, lr=0.01), ref, 3, torch.float32)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_step_hooks_run_around_every_step():
    params = _params()
    opt = HybridDeviceOptimizer(params, 1.0, lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    _run(opt, params, 2, torch.float32)
    assert calls == ["pre", "post", "pre", "post"]


def test_frozen_and_gradless_params_get_no_update_and_no_state():
    params = _params()
    params[1].requires_grad_(False)
    before = [p.detach().clone() for p in params]
    opt = HybridDeviceOptimizer(params, 1.0, lr=0.1, bucket_numel=24)
    for step in range(3):
        for i, (p, g) in enumerate(zip(params, _grads(step, torch.float32))):
            p.grad = g if i not in (1, 2) else None  # 1 frozen, 2 never gets a gradient
        opt.step()
    for i in (1, 2):
        assert torch.equal(params[i], before[i])
        assert params[i] not in opt.state
    assert not torch.equal(params[0], before[0]) and params[0] in opt.state
    opt.materialize_state()
    assert params[2] in opt.state and params[1] not in opt.state  # frozen: never


def test_a_param_that_gets_its_first_grad_late_matches_torch():
    ours, ref = _params(), _params()
    opt = HybridDeviceOptimizer(ours, 1.0, lr=0.01, bucket_numel=100)
    ref_opt = torch.optim.AdamW(ref, lr=0.01)
    for step in range(5):
        for p, q, g in zip(ours, ref, _grads(step, torch.float32)):
            p.grad = q.grad = None
            if step >= 2 or p is not ours[0]:
                p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert opt.state[ours[0]]["step"].item() == 3
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("overlap", [True, False])
def test_gradient_accumulation_and_clipping_after_backward_match_torch(overlap):
    """Grads staged by the post-accumulate hook must be restaged when a later backward or clipping changes them."""
    model, ref = _tiny_model(), _tiny_model()
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=0.01, overlap_cpu_optimizer_d2h_h2d=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        batches = [torch.randn(4, 6, generator=gen) for _ in range(3)]
        for m, o in ((model, opt), (ref, ref_opt)):
            for x in batches:  # three micro-batches accumulate into .grad
                m(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # in-place, after the hooks ran
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_zero_grad_keeps_buffers_unless_set_to_none():
    params = _params()
    opt = HybridDeviceOptimizer(params, 0.5, lr=0.01)
    _run(opt, params, 1, torch.float32)
    buffers = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is b and not b.any() for p, b in zip(params, buffers))
    params[0].decoupled_grad = torch.ones_like(params[0])
    opt.zero_grad(set_to_none=False)
    assert not params[0].decoupled_grad.any()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params) and params[0].decoupled_grad is None


def test_decoupled_fp32_grads_of_bf16_params_are_used_when_staged_in_fp32():
    from optim import PrecisionPolicy, set_grad

    ours = _params(torch.bfloat16)
    ref = [p.detach().float().requires_grad_() for p in ours]
    opt = HybridDeviceOptimizer(ours, 1.0, lr=0.01, precision=PrecisionPolicy(main_grads_dtype=torch.float32))
    ref_opt = torch.optim.AdamW(ref, lr=0.01)
    for step in range(3):
        for p, q, g in zip(ours, ref, _grads(step, torch.float32)):
            set_grad(p, g.clone())  # fp32 grad of a bf16 param -> decoupled_grad
            q.grad = g.clone()
        assert ours[0].grad is None
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(opt.state[a]["master_param"], b, rtol=1e-5, atol=1e-6)


def test_wrapping_an_existing_optimizer_keeps_its_class_groups_and_state():
    ours, ref = _params(), _params()
    inner = torch.optim.Adam(_groups(ours), lr=0.02, weight_decay=0.05)
    ref_opt = torch.optim.Adam(_groups(ref), lr=0.02, weight_decay=0.05)
    _run(inner, ours, 2, torch.float32)
    _run(ref_opt, ref, 2, torch.float32)
    opt = HybridDeviceOptimizer(inner, 1.0, bucket_numel=24)
    assert opt.cpu_optimizer_cls is torch.optim.Adam and opt.defaults == inner.defaults
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.002]
    for step in range(2, 5):
        for p, q, g in zip(ours, ref, _grads(step, torch.float32)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_named_parameters_are_accepted_and_named_in_errors():
    model = _tiny_model()
    opt = HybridDeviceOptimizer(model.named_parameters(), 1.0, lr=0.01)
    assert opt.param_groups[0]["param_names"][0] == "0.weight"
    model[2].bias.decoupled_grad = torch.zeros(5)  # torch refuses a mis-shaped .grad; decoupled_grad is not checked
    with pytest.raises(ValueError, match=r"'2\.bias'"):
        opt.step()


def test_closure_loss_is_returned():
    model, ref = _tiny_model(), _tiny_model()
    opt = HybridDeviceOptimizer(model.parameters(), 0.5, lr=0.01)
    x = torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.equal(loss, ref(x).sum())


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cache_sized_pieces_that_split_params_give_the_same_update_as_whole_buckets(state_dtype):
    """Piece boundaries (inside params, across params, with a gradless param) must not change the result."""
    from offload_fsdp import fused_step
    from optim import PrecisionPolicy

    policy = PrecisionPolicy(exp_avg_dtype=state_dtype, exp_avg_sq_dtype=state_dtype)
    results = []
    for piece in (7, 1 << 18):
        params = _params(torch.bfloat16)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fused_step, "PIECE_NUMEL", piece)
            opt = HybridDeviceOptimizer(_groups(params), 1.0, lr=0.01, precision=policy)
        for step in range(3):
            for i, (p, g) in enumerate(zip(params, _grads(step, torch.bfloat16))):
                p.grad = None if (i == 1 and step == 1) else g
            opt.step()
        results.append(params)
    if state_dtype == torch.float32:
        for a, b in zip(*results):
            assert torch.equal(a, b)
    else:  # the rounding noise depends on the piece grid: equal up to bf16 moment rounding
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=0, atol=0.02)


def test_partition_is_logged_once_at_construction(caplog):
    params = _params(torch.bfloat16)
    with caplog.at_level("INFO", logger="offload_fsdp.optimizer"):
        HybridDeviceOptimizer(params, 0.5, lr=0.01)
    messages = [r.getMessage() for r in caplog.records if "partition" in r.getMessage()]
    host = sum(p.numel() for p in params[:2])  # 21 + 5 elements: the whole-param prefix nearest to half of 48
    device = sum(p.numel() for p in params[2:])  # the rest: 16 + 0 + 6 elements, the empty param included
    assert len(messages) == 1
    assert f"host 2 params / {host} elements / {2 * host} bytes" in messages[0]
    assert f"device 3 params / {device} elements / {2 * device} bytes, 1 buckets" in messages[0]
    # No accelerator: nothing crosses a bus, so nothing is pinned; every host buffer is pageable.
    assert "pinned host bytes reserved 0, used 0 (page-locked: False)" in messages[0]
    pageable = int(re.search(r"pageable host bytes (\d+)", messages[0]).group(1))
    used = host * (2 + 2 + 4 + 4 + 4)  # bf16 grad + bf16 param staging + fp32 master + 2 fp32 moments
    assert used <= pageable < used + 64 * 5, "exact size up to 64-byte alignment of each of the 5 buffers"


class _CountingSGD(torch.optim.SGD):
    """SGD that counts its instances; its own ``step`` makes it a class without a host kernel (a subclass
    keeping SGD's step is matched as SGD: offload_fsdp.per_element), so it is delegated per bucket."""

    built = 0
    sizes: list[list[int]] = []
    """per instance built, the numel of each param it updates"""

    def __init__(self, params, *args, **kwargs):
        type(self).built += 1
        params = list(params)
        super().__init__(params, *args, **kwargs)
        type(self).sizes.append([p.numel() for g in self.param_groups for p in g["params"]])

    def step(self, closure=None):
        return super().step(closure)


def test_a_class_without_fused_kernel_runs_as_one_instance_per_bucket_and_matches_torch():
    _CountingSGD.built, _CountingSGD.sizes = 0, []
    ours, ref = _params(), _params()
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    opt = HybridDeviceOptimizer(_groups(ours), 1.0, cpu_optimizer_cls=_CountingSGD, bucket_numel=24, **kw)
    buckets = opt.layout().buckets
    assert len(buckets) >= 2 and max(len(b.params) for b in buckets) >= 2, "the test needs multi-param buckets"
    assert all(b.kernel is None for b in buckets)
    _CountingSGD.built -= 1  # the explicit form's throw-away instance that validates the hyper-parameters
    assert _CountingSGD.built == len(buckets)
    params = [p for group in opt.param_groups for p in group["params"]]
    numel = {placed.name: p.numel() for p, placed in zip(params, opt.layout().params)}
    # each instance updates exactly its bucket's params (the throw-away instance came first)
    assert _CountingSGD.sizes[1:] == [[numel[name] for name in b.params] for b in buckets]
    _run(opt, ours, 3, torch.float32)
    _run(torch.optim.SGD(_groups(ref), **kw), ref, 3, torch.float32)
    assert _CountingSGD.built == len(buckets), "stepping builds no further instances"
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _record_grad_copies(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The list that each D2H grad copy (the CPU's copy engine) appends its (destination, source) to."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = SyncCopyEngine.stage_grad
    monkeypatch.setattr(
        SyncCopyEngine,
        "stage_grad",
        lambda self, bucket, dst, src: (copies.append((dst, src)), original(self, bucket, dst, src)),
    )
    return copies


def test_grads_are_staged_during_backward_and_not_copied_again_by_step(monkeypatch):
    model = _tiny_model()
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=0.01)
    copies = _record_grad_copies(monkeypatch)
    model(torch.randn(4, 6)).sum().backward()
    assert len(copies) == 4, "each param's D2H starts from its post-accumulate-grad hook"
    assert {id(src) for _, src in copies} == {id(p.grad) for p in model.parameters()}
    for staged, grad in copies:
        assert torch.equal(staged, grad)
    opt.step()
    assert len(copies) == 4, "unchanged grads are not copied again"


def test_deferred_grad_copies_copy_only_the_final_accumulated_grad_with_the_same_result(monkeypatch):
    """3 micro-batches: hooks copy each param's grad 3 times; deferring the first two leaves 1 copy."""
    results = {}
    for defer in (False, True):
        model = _tiny_model()
        opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=0.01)
        copies = _record_grad_copies(monkeypatch)
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            batches = [torch.randn(4, 6, generator=gen) for _ in range(3)]
            for i, x in enumerate(batches):
                with opt.defer_grad_copies() if defer and i < 2 else contextlib.nullcontext():
                    model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results[defer] = ([p.detach().clone() for p in model.parameters()], len(copies))
    (eager, eager_copies), (deferred, deferred_copies) = results[False], results[True]
    assert (eager_copies, deferred_copies) == (2 * 3 * 4, 2 * 4)
    for a, b in zip(eager, deferred):
        assert torch.equal(a, b)


def test_maximize_and_adam_decoupled_weight_decay_follow_torch():
    for cls, kw in ((torch.optim.Adam, dict(maximize=True, weight_decay=0.1)),
                    (torch.optim.Adam, dict(decoupled_weight_decay=True, weight_decay=0.1))):  # fmt: skip
        ours, ref = _params(), _params()
        opt = HybridDeviceOptimizer(ours, 1.0, cpu_optimizer_cls=cls, lr=0.01, **kw)
        _run(opt, ours, 3, torch.float32)
        _run(cls(ref, lr=0.01, **kw), ref, 3, torch.float32)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_without_fp32_update_bf16_params_are_their_own_master(fraction):
    ours = _params(torch.bfloat16)
    ref = [p.detach().float().requires_grad_() for p in ours]
    opt = HybridDeviceOptimizer(ours, fraction, lr=0.01, param_update_in_fp32=False)
    _run(opt, ours, 5, torch.bfloat16)
    _run(torch.optim.AdamW(ref, lr=0.01), ref, 5, torch.bfloat16)
    assert "master_param" not in opt.state[ours[0]]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.float(), b, rtol=0, atol=0.05)  # bf16 rounding each step


@pytest.mark.parametrize("decay_passed", [False, True])
def test_a_different_device_class_steps_its_share_like_its_plain_class_with_its_own_defaults(decay_passed):
    """cpu AdamW + gpu SGD at fraction 0.5: each share matches its plain class over its params.

    AdamW's default weight_decay=0.01 fills the wrapper's groups; it reaches the
    SGD share only when passed explicitly or changed later (then both shares use it).
    A key only SGD reads (momentum) can be given in a group dict.
    """
    ours, ref = _params(), _params()
    kw = dict(lr=0.01, **({"weight_decay": 0.01} if decay_passed else {}))
    groups = _groups(ours)
    groups[0]["momentum"] = 0.9
    opt = HybridDeviceOptimizer(
        groups, 0.5, cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.SGD, bucket_numel=24, **kw
    )
    assert opt.layout().offloaded == (True, True, False, False, False)
    host_ref = torch.optim.AdamW(ref[:2], **kw)  # the host share: params 0, 1 of group 0
    device_ref = torch.optim.SGD(
        [{"params": ref[2:3], "momentum": 0.9}, {"params": ref[3:], "lr": 0.002, "weight_decay": 0.0}], **kw
    )
    optimizers = (opt, host_ref, device_ref)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s) for o in optimizers]
    for step in range(4):
        if step == 2:  # a later change of a value left at the host class's default applies to both shares
            for o in optimizers:
                o.param_groups[0]["weight_decay"] = 0.05
        for p, q, g in zip(ours, ref, _grads(step, torch.float32)):
            p.grad, q.grad = g.clone(), g.clone()
        for o, s in zip(optimizers, schedulers):
            o.step()
            s.step()
    assert opt.param_groups[0]["weight_decay"] == 0.05 and "momentum" in opt.param_groups[0]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_wrapped_optimizer_and_later_groups_share_with_another_device_class_only_what_the_user_set():
    def device_decay(opt):
        # Private: the device class's own group values; the update shows them only through many steps.
        return [g["weight_decay"] for g in opt._placement.device_delegate.inner.param_groups]

    for decay, expected in ((0.01, 0.0), (0.1, 0.1)):  # AdamW's default stays AdamW's; a chosen value is shared
        params = [torch.zeros(4, requires_grad=True) for _ in range(2)]
        inner = torch.optim.AdamW(params, lr=0.01, weight_decay=decay)
        opt = HybridDeviceOptimizer(inner, 0.5, gpu_optimizer_cls=torch.optim.SGD)
        assert device_decay(opt) == [expected]
    opt = HybridDeviceOptimizer(
        [torch.zeros(4, requires_grad=True)], 0.0, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.SGD, lr=0.01,
    )  # fmt: skip
    opt.add_param_group({"params": [torch.zeros(4, requires_grad=True)]})
    opt.add_param_group({"params": [torch.zeros(4, requires_grad=True)], "weight_decay": 0.01})
    assert device_decay(opt) == [0.0, 0.0, 0.01]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.01, 0.01]  # the wrapper shows AdamW's
