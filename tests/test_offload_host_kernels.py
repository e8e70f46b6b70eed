"""Host kernels (:mod:`offload_fsdp.host_kernels`): SGD's against torch, bit for bit, and the registry.

The SGD host kernel runs torch's fused CPU SGD kernel over flat buckets, so its
reference is ``torch.optim.SGD(fused=True)`` (torch's default CPU path, the
single-tensor loop, rounds differently in the last bit). bf16 params are compared
with a reference that steps fp32 copies (the master) on the same bf16-valued grads.
Stated tolerance: none (``torch.equal``) on params, masters and momentum buffers.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import checkpoint
from offload_fsdp import HybridDeviceOptimizer, fused_step
from offload_fsdp.host_kernels import SgdKernel, host_kernel_for, register_host_kernel
from offload_fsdp.per_element import PER_ELEMENT_OPTIMIZERS, qualified_name
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.records import ParamShard
from offload_fsdp.sgd_step import SPLIT_UNIT, unit_pieces
from tests.distributed import run_ranks

BF16, FP32 = torch.bfloat16, torch.float32
SHAPES = [(7, 3), (5,), (4, 4), (0, 3), (6,), (150,)]  # an empty shard, and one split between pieces
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": dict(lr=0.05),
    "weight_decay": dict(lr=0.05, weight_decay=0.01),
    "momentum": dict(lr=0.05, momentum=0.9),
    "momentum+weight_decay": dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    "dampening": dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "maximize": dict(lr=0.05, momentum=0.8, dampening=0.1, maximize=True),
}


def _params(dtype: torch.dtype = FP32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    # two groups; the second overrides lr and weight decay
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.02, "weight_decay": 0.05}]


def _set_grads(params: list[torch.Tensor], step: int, skip: set[int] = frozenset()) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).bfloat16()  # bf16 values: exact in every dtype used here
        p.grad = None if i in skip else g.to(p.dtype)


def _run(opt, params, start: int, stop: int, skip_at: dict[int, set[int]] | None = None) -> None:
    for step in range(start, stop):
        _set_grads(params, step, (skip_at or {}).get(step, set()))
        opt.step()


def _ours(params, fraction: float, **hyper) -> HybridDeviceOptimizer:
    # fused=True: the device share (fraction < 1) runs torch's fused SGD too, like the reference
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fused_step, "PIECE_NUMEL", 100)  # pieces of 64: records start and end mid-piece, and span pieces
        return HybridDeviceOptimizer(torch.optim.SGD(_groups(params), fused=True, **hyper), fraction, bucket_numel=24)


def _reference(params, **hyper) -> torch.optim.Optimizer:
    return torch.optim.SGD(_groups(params), fused=True, **hyper)


def _assert_matches(opt, ours, ref_opt, ref) -> None:
    """Params (or, for low-precision params, their masters) and momentum buffers equal bit for bit."""
    for i, (p, q) in enumerate(zip(ours, ref)):
        state, ref_state = opt.state.get(p, {}), ref_opt.state.get(q, {})
        # the fp32 master the update runs on (the device share without momentum keeps no state to show it in)
        # Private: the device share's master without momentum is in no state dict, so nothing public shows it.
        master = opt._placement.records[i].working if p.dtype != q.dtype else p
        assert torch.equal(master, q), f"param {i}"
        if p.dtype != q.dtype:
            assert torch.equal(p, master.to(p.dtype)), f"param {i} is not its master's cast"
        assert set(state) - {"master_param"} == set(ref_state), f"param {i}: state keys"
        if "momentum_buffer" in ref_state:
            assert torch.equal(state["momentum_buffer"], ref_state["momentum_buffer"]), f"param {i} momentum"


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sgd_host_kernel_matches_torch_fused_sgd_bit_for_bit(config, fraction, dtype):
    ours = _params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]  # the fp32 master starts as the exact upcast
    opt, ref_opt = _ours(ours, fraction, **CONFIGS[config]), _reference(ref, **CONFIGS[config])
    host = opt.layout().buckets
    assert len(host) >= 2 and all(b.kernel == SgdKernel.name for b in host)
    _run(opt, ours, 0, 4)
    _run(ref_opt, ref, 0, 4)
    _assert_matches(opt, ours, ref_opt, ref)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    active_mask=st.lists(st.booleans(), min_size=8, max_size=8),
    units=st.integers(1, 4),
)
def test_sgd_pieces_cover_the_active_elements_once_and_cut_records_only_at_split_units(sizes, active_mask, units):
    numel, offset, records = units * SPLIT_UNIT, 0, []
    for n in sizes:
        records.append(ParamShard(param=torch.zeros(n), name=f"p{len(records)}", group_index=0, offset=offset))
        offset += n
    active = [r for r, on in zip(records, active_mask) if on]
    covered: dict[int, list[tuple[int, int]]] = {}
    last_stop = -1
    for start, stop, segs in unit_pieces(active, numel):
        assert segs and last_stop <= start < stop <= start + numel
        last_stop = stop
        for b, e, r in segs:
            assert start <= b < e <= stop
            covered.setdefault(id(r), []).append((b, e))
    for r in active:
        spans = covered.get(id(r), [])
        if r.numel == 0:
            assert not spans
            continue
        assert spans[0][0] == r.offset and spans[-1][1] == r.offset + r.numel
        for (_, e), (b, _) in zip(spans, spans[1:]):
            assert e == b and (b - r.offset) % SPLIT_UNIT == 0, "a cut inside a record off the split unit"


def test_a_param_whose_first_grad_comes_late_starts_its_momentum_from_that_grad():
    """Param 1 has no grad at steps 0 and 1: no update and no state, then torch's first-step buffer."""
    hyper = CONFIGS["dampening"]
    ours, ref = _params(), _params()
    opt = _ours(ours, 1.0, **hyper)
    # One optimizer per param: torch's fused SGD refuses a call mixing new and existing buffers.
    refs = [
        torch.optim.SGD([{**group, "params": [q]}], fused=True, **hyper)
        for group in _groups(ref)
        for q in group["params"]
    ]
    skip_at = {0: {1}, 1: {1}}
    for step in range(4):
        _set_grads(ours, step, skip_at.get(step, set()))
        _set_grads(ref, step, skip_at.get(step, set()))
        if step == 0:
            assert ours[1].grad is None
        opt.step()
        for r in refs:
            r.step()
        if step == 1:
            assert ours[1] not in opt.state and 1 not in opt.state_dict()["state"]
    for i, (p, q, r) in enumerate(zip(ours, ref, refs)):
        assert torch.equal(p, q), i
        assert torch.equal(opt.state[p]["momentum_buffer"], r.state[q]["momentum_buffer"]), i


def test_materialized_momentum_buffers_are_placeholders_the_first_step_replaces_with_the_grad():
    """After materialize_state (zeros to load into), the first step still starts the buffer from the grad."""
    hyper = CONFIGS["dampening"]
    ours, ref = _params(BF16), _params(BF16)
    ref = [p.detach().float().clone().requires_grad_() for p in ref]
    opt, ref_opt = _ours(ours, 1.0, **hyper), _reference(ref, **hyper)
    opt.materialize_state()
    assert all(torch.equal(opt.state[p]["momentum_buffer"], torch.zeros(p.shape)) for p in ours)
    _run(opt, ours, 0, 3)
    _run(ref_opt, ref, 0, 3)
    _assert_matches(opt, ours, ref_opt, ref)


def test_a_state_dict_taken_after_materialize_state_resumes_as_the_run_that_never_saved():
    hyper = CONFIGS["dampening"]
    straight, saved_from, resumed = _params(), _params(), _params()
    straight_opt = _ours(straight, 1.0, **hyper)
    saved_opt = _ours(saved_from, 1.0, **hyper)
    saved_opt.materialize_state()  # e.g. by a loader that then found nothing to load
    resumed_opt = _ours(resumed, 1.0, **hyper)
    resumed_opt.load_state_dict(copy.deepcopy(saved_opt.state_dict()))
    _run(straight_opt, straight, 0, 2)
    _run(resumed_opt, resumed, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_sgd_without_momentum_keeps_no_state_for_fp32_params_and_only_the_master_for_bf16():
    fp32, bf16 = _params(), _params(BF16)
    for params in (fp32, bf16):
        opt = _ours(params, 1.0, lr=0.1)
        assert all(not b.state_dtypes for b in opt.layout().buckets)  # no buffer allocated
        _run(opt, params, 0, 1)
        if params is fp32:
            assert opt.state_dict()["state"] == {}
        else:
            assert all(set(opt.state[p]) == {"master_param"} for p in params)


def test_state_dicts_load_across_torch_sgd_and_the_host_kernel_and_continue_bit_exact():
    hyper = CONFIGS["nesterov"]
    ours, ref = _params(), _params()
    opt, ref_opt = _ours(ours, 1.0, **hyper), _reference(ref, **hyper)
    _run(opt, ours, 0, 2)
    _run(ref_opt, ref, 0, 2)
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()
    # cross over: each continues from the other's state (weights are equal already)
    # copies: torch's load_state_dict keeps the very tensors it is given, and each would step the other's buffers
    ref_sd, our_sd = copy.deepcopy(ref_opt.state_dict()), copy.deepcopy(opt.state_dict())
    opt.load_state_dict(ref_sd)
    ref_opt.load_state_dict(our_sd)
    _run(opt, ours, 2, 4)
    _run(ref_opt, ref, 2, 4)
    _assert_matches(opt, ours, ref_opt, ref)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_a_momentum_buffer_saved_as_none_loads_as_no_buffer_and_steps_as_torch(momentum, dtype):
    """Older torch saved ``momentum_buffer=None`` (SGD without momentum); torch loads it and starts afresh."""
    ours = _params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]
    opt, ref_opt = _ours(ours, 1.0, lr=0.05, momentum=momentum), _reference(ref, lr=0.05, momentum=momentum)
    for o in (opt, ref_opt):
        saved = copy.deepcopy(o.state_dict())
        saved["state"] = {i: {"momentum_buffer": None} for i in range(len(SHAPES))}
        o.load_state_dict(saved)
    _run(opt, ours, 0, 3)
    _run(ref_opt, ref, 0, 3)
    for q in ref:  # torch keeps the loaded None where it has no buffer; ours keeps no entry (same meaning)
        if ref_opt.state[q].get("momentum_buffer", 0) is None:
            del ref_opt.state[q]["momentum_buffer"]
    _assert_matches(opt, ours, ref_opt, ref)


def test_state_loaded_into_sgd_that_keeps_none_is_refused_naming_the_param_and_key():
    """fp32 params, no momentum: torch's SGD keeps no state, so a saved momentum buffer is another setup's."""
    opt = _ours(_params(), 1.0, lr=0.05)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"] = {0: {"momentum_buffer": torch.zeros(SHAPES[0])}}
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*momentum_buffer.*expected \[\]"):
        opt.load_state_dict(saved)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).bfloat16()


def _train(model, opt, start, stop):
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(8, 16, generator=gen).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _build(seed, fraction):
    model = _model(seed)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, fused=True)
    return model, HybridDeviceOptimizer(sgd, fraction, bucket_numel=300)


def _through_state_dict(path, model, opt, fresh_model, fresh_opt):
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    fresh_model.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optim"])


def _through_checkpoint(path, model, opt, fresh_model, fresh_opt):
    checkpoint.save(path, model=model, optimizer=opt)
    checkpoint.load(path, model=fresh_model, optimizer=fresh_opt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("route", [_through_state_dict, _through_checkpoint], ids=["state_dict", "checkpoint"])
def test_sgd_resume_of_bf16_params_is_bit_exact(tmp_path, route, fraction):
    straight, straight_opt = _build(0, fraction)
    _train(straight, straight_opt, 0, 5)
    model, opt = _build(0, fraction)
    assert all(b.kernel == SgdKernel.name for b in opt.layout().buckets) and len(opt.layout().buckets) >= 2 * fraction
    _train(model, opt, 0, 3)
    fresh_model, fresh_opt = _build(7, fraction)  # other weights: everything must come from the load
    route(tmp_path / "ck", model, opt, fresh_model, fresh_opt)
    _train(fresh_model, fresh_opt, 3, 5)
    for a, b in zip(straight.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(straight.parameters(), fresh_model.parameters()):
        sa, sb = straight_opt.state[a], fresh_opt.state[b]
        assert sa.keys() == sb.keys() == {"momentum_buffer", "master_param"}
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_momentum_turned_on_after_construction_is_refused_naming_the_missing_buffer():
    params = _params()
    opt = _ours(params, 1.0, lr=0.1)
    opt.param_groups[1]["momentum"] = 0.9
    _set_grads(params, 0)
    with pytest.raises(ValueError, match=r"param group 1: .*momentum_buffer.*momentum from 0"):
        opt.step()


def test_sgd_subclasses_overriding_step_and_differentiable_groups_run_the_class_per_bucket():
    class LoggingSGD(torch.optim.SGD):  # keeps SGD.step: matched as SGD (one rule with per_element)
        pass

    class ClippedSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    assert isinstance(host_kernel_for(LoggingSGD), SgdKernel)
    sub = HybridDeviceOptimizer(ClippedSGD(_params(), lr=0.1, momentum=0.9), 1.0)
    assert host_kernel_for(ClippedSGD) is None and all(b.kernel is None for b in sub.layout().buckets)
    diff = HybridDeviceOptimizer(torch.optim.SGD(_params(), lr=0.1, differentiable=True), 1.0)
    assert all(b.kernel is None for b in diff.layout().buckets)


def test_build_optimizer_offloads_sgd_through_the_host_kernel():
    from optim import build_optimizer

    params = [torch.nn.Parameter(p.detach()) for p in _params()]
    opt = build_optimizer(params, "sgd", offload_fraction=1.0, lr=0.1, momentum=0.9)
    assert isinstance(opt, HybridDeviceOptimizer) and opt.cpu_optimizer_cls is torch.optim.SGD
    assert all(b.kernel == SgdKernel.name for b in opt.layout().buckets)


# ---------------------------------------------------------------- the registry, with a third class


class SignSGD(torch.optim.Optimizer):
    """p -= lr * sign(grad); keeps the last sign as state: a tiny elementwise class to register."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["last_sign"] = p.grad.sign()
                    p.add_(self.state[p]["last_sign"], alpha=-group["lr"])


class SignKernel:
    """The same update over flat buckets; counts the elements it stepped."""

    name = "SignSGD"
    has_step = False
    dtypes = (FP32,)
    master_dtypes = (FP32,)
    moment_dtypes_from_policy = False
    stepped: list[int] = []

    def unsupported(self, group):
        return None

    def state_layout(self, group, master_dtype, precision: PrecisionPolicy):
        return {"last_sign": master_dtype}

    def step_bucket(self, bucket, active, group, scratch):
        for r in active:
            sl = slice(r.offset, r.offset + r.numel)
            bucket.state["last_sign"][sl].copy_(bucket.grad_stage[sl].sign())
            bucket.master[sl].add_(bucket.state["last_sign"][sl], alpha=-group["lr"])
            SignKernel.stepped.append(r.numel)


def test_a_registered_third_class_gets_its_host_kernel_and_matches_the_class_itself():
    SignKernel.stepped = []
    register_host_kernel(SignSGD, SignKernel)
    try:
        ours, ref = _params(), _params()
        opt = HybridDeviceOptimizer(SignSGD(ours, lr=0.1), 1.0, bucket_numel=24)
        assert all(b.kernel == SignKernel.name for b in opt.layout().buckets)
        ref_opt = SignSGD(ref, lr=0.1)
        _run(opt, ours, 0, 2)
        _run(ref_opt, ref, 0, 2)
        assert sum(SignKernel.stepped) == 2 * sum(p.numel() for p in ours)
        for p, q in zip(ours, ref):
            assert torch.equal(p, q)
            assert torch.equal(opt.state[p]["last_sign"], ref_opt.state[q]["last_sign"])
    finally:
        PER_ELEMENT_OPTIMIZERS.pop(qualified_name(SignSGD))
    assert all(b.kernel is None for b in HybridDeviceOptimizer(SignSGD(_params()), 1.0).layout().buckets)


def test_registering_something_that_is_not_an_optimizer_class_is_a_type_error():
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        register_host_kernel(SignKernel, SignKernel)  # type: ignore[arg-type]


# ---------------------------------------------------------------- FSDP2, 2 ranks


def _fsdp_sgd_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    hyper = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)

    def sharded() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def train(model, step_fn) -> None:
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(4, 6, generator=gen)).square().mean().backward()
            step_fn()
            model.zero_grad()

    ref, ours = sharded(), sharded()
    # DTensor has no sharding rule for torch's fused SGD: the reference steps the local shards themselves
    # (detached aliases of the params' storage), which is what a per-element update on shards must equal.
    shards = [p.to_local().detach() for p in ref.parameters()]
    ref_opt = torch.optim.SGD(shards, fused=True, **hyper)

    def ref_step() -> None:
        for shard, p in zip(shards, ref.parameters()):
            shard.grad = p.grad.to_local()
        ref_opt.step()

    opt = HybridDeviceOptimizer(torch.optim.SGD(ours.parameters(), **hyper), 1.0)
    train(ref, ref_step)
    train(ours, opt.step)
    return {
        "kernel": all(b.kernel == SgdKernel.name for b in opt.layout().buckets),
        "params": all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ours.parameters(), ref.parameters())),
        "momentum": all(
            torch.equal(opt.state[p]["momentum_buffer"].to_local(), ref_opt.state[shard]["momentum_buffer"])
            for p, shard in zip(ours.parameters(), shards)
        ),
        "moved": not torch.equal(next(ref.parameters()).to_local(), next(sharded().parameters()).to_local()),
    }


@pytest.mark.slow
def test_fsdp2_sgd_through_the_host_kernel_matches_torch_fused_sgd_on_2_ranks():
    for rank, result in enumerate(run_ranks(_fsdp_sgd_body, 2)):
        assert result == {"kernel": True, "params": True, "momentum": True, "moved": True}, rank


RESHARD_SETUPS = {"momentum": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01), "plain": dict(lr=0.05)}


def _reshard_setup(world_size: int, seed: int, hyper: dict) -> tuple[torch.nn.Module, HybridDeviceOptimizer]:
    """bf16 FSDP2 model whose last layer gets no grad before step 3; half the params on the device share."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 3))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    model = fully_shard(model.bfloat16(), mesh=mesh)
    return model, HybridDeviceOptimizer(torch.optim.SGD(model.parameters(), **hyper), 0.5, bucket_numel=24)


def _reshard_train(model: torch.nn.Module, opt: HybridDeviceOptimizer, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        out = model[2](model[1](model[0](torch.randn(4, 6, generator=gen).bfloat16())))
        (model[3](out) if step >= 3 else out).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full_training_state(model: torch.nn.Module, opt: HybridDeviceOptimizer) -> dict[str, torch.Tensor]:
    full = {}
    for i, p in enumerate(model.parameters()):
        full[f"{i}"] = p.full_tensor()
        for name, value in opt.state.get(p, {}).items():
            full[f"{i}.{name}"] = value.full_tensor()
    return full


def _reshard_body(rank: int, world_size: int, root: str, save: bool) -> dict:
    results = {}
    for setup, hyper in RESHARD_SETUPS.items():
        model, opt = _reshard_setup(world_size, 0 if save else 7, hyper)
        if save:
            _reshard_train(model, opt, rank, range(3))
            checkpoint.save(f"{root}/{setup}", model=model, optimizer=opt)
            results[setup] = _full_training_state(model, opt)
        else:
            checkpoint.load(f"{root}/{setup}", model=model, optimizer=opt)
            results[setup] = _full_training_state(model, opt)
            _reshard_train(model, opt, rank, range(3, 4))  # the last layer's first step, after the load
            results[f"{setup} stepped"] = {k for k, v in _full_training_state(model, opt).items() if v.isfinite().all()}
    return results


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_sgd_state_saved_on_2_fsdp2_ranks_loads_on_3_exactly_masters_and_missing_momentum_included(tmp_path):
    saved = run_ranks(_reshard_body, 2, (str(tmp_path), True))[0]
    loaded = run_ranks(_reshard_body, 3, (str(tmp_path), False))[0]
    for setup in RESHARD_SETUPS:
        # the never-stepped last layer (params 4, 5) has no momentum buffer; every bf16 param has its master
        assert "4.momentum_buffer" not in saved[setup] and "0.master_param" in saved[setup], setup
        assert saved[setup].keys() == loaded[setup].keys(), setup
        assert all(torch.equal(saved[setup][k], loaded[setup][k]) for k in saved[setup]), setup
        assert {"4.master_param", "5.master_param"} <= loaded[f"{setup} stepped"], setup
    assert "4.momentum_buffer" in loaded["momentum stepped"]


# ---------------------------------------------------------------- Adam(W), the first entry


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fp32_adam_host_kernel_is_torch_fused_adam_bit_for_bit(cls):
    """All-fp32 buckets run torch's fused kernel over whole records, through its public entry."""
    ours, ref = _params(), _params()
    opt = HybridDeviceOptimizer(cls(_groups(ours), lr=0.01, weight_decay=0.1), 1.0, bucket_numel=24)
    ref_opt = cls(_groups(ref), lr=0.01, weight_decay=0.1, fused=True)
    assert len(opt.layout().buckets) >= 2 and all(b.kernel is not None for b in opt.layout().buckets)
    _run(opt, ours, 0, 3)
    _run(ref_opt, ref, 0, 3)
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert torch.equal(p, q), i
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state.keys() == ref_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[k], ref_state[k]) for k in state), i


def test_momentum_off_for_a_first_step_then_on_starts_the_buffer_from_the_grad_as_torch_does():
    """With momentum 0 torch keeps no buffer; turned back on, the buffer starts from that step's grad."""
    hyper = CONFIGS["dampening"]
    ours, ref = _params(BF16), _params(BF16)
    ref = [p.detach().float().clone().requires_grad_() for p in ref]
    opt, ref_opt = _ours(ours, 1.0, **hyper), _reference(ref, **hyper)
    for step in range(3):
        for o in (opt, ref_opt):
            o.param_groups[0]["momentum"] = 0.0 if step == 0 else 0.9
        _run(opt, ours, step, step + 1)
        _run(ref_opt, ref, step, step + 1)
    _assert_matches(opt, ours, ref_opt, ref)


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_sgd_without_fp32_masters_runs_torch_sgd_itself_on_the_low_precision_masters(dtype):
    """param_update_in_fp32=False: low-precision masters are not the kernel's (see the next test): the
    buckets run torch's SGD per bucket, as torch steps such params."""
    hyper = CONFIGS["nesterov"]
    ours, ref = _params(dtype), _params(dtype)
    opt = HybridDeviceOptimizer(
        torch.optim.SGD(_groups(ours), **hyper), 1.0, bucket_numel=24, param_update_in_fp32=False
    )
    assert all(b.kernel is None for b in opt.layout().buckets)
    ref_opt = torch.optim.SGD(_groups(ref), **hyper)
    _run(opt, ours, 0, 3)
    _run(ref_opt, ref, 0, 3)
    _assert_matches(opt, ours, ref_opt, ref)
    assert not torch.equal(ours[0], _params(dtype)[0]), "the params must have moved"


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_torch_fused_sgd_still_leaves_low_precision_params_unstepped(dtype):
    """Why SgdKernel.master_dtypes is fp32 only. When this fails, torch fixed its fused CPU SGD kernel for
    bf16/fp16: allow them in SgdKernel.master_dtypes (and compare with SGD(fused=True) on such params)."""
    p = torch.ones(64, dtype=dtype, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.5, fused=True)
    p.grad = torch.ones(64, dtype=dtype)
    opt.step()
    assert torch.equal(p, torch.ones(64, dtype=dtype)), "torch's fused SGD now updates bf16/fp16 params"


def test_sgd_on_bf16_params_with_fp32_decoupled_grads_matches_an_fp32_master_reference():
    """fp32 grads (main_grads_dtype) need no cast, but the bf16 param staging still walks pieces."""
    hyper = CONFIGS["momentum+weight_decay"]
    ours = _params(BF16)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fused_step, "PIECE_NUMEL", 100)
        opt = HybridDeviceOptimizer(
            torch.optim.SGD(_groups(ours), fused=True, **hyper),
            1.0,
            bucket_numel=24,
            precision=PrecisionPolicy(main_grads_dtype=FP32),
        )
    assert all(b.grad_dtype == FP32 and b.param_staging for b in opt.layout().buckets)
    ref_opt = _reference(ref, **hyper)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, generator=gen)  # full fp32 values: no bf16 rounding anywhere
            p.decoupled_grad, q.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    _assert_matches(opt, ours, ref_opt, ref)
