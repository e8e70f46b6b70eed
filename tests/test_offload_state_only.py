"""State-only offload (``offload_state_only=True``): the device share's update on the device, its masters and
state parked on the host between steps.

Every run here goes through the emulated asynchronous device of ``tests/fakes/deferred_queues.py``
(substituted where :mod:`offload_fsdp.state_only` chooses a device's parking): a copy runs only when
waited on and its destination reads NaN until then, so an update reading state before its H2D landed,
or a host read (state_dict, checkpoint, load) before a write-back landed, shows up as a wrong result.
Its allocator counts the device bytes the parked share holds (live device buffers), for the budget.
Stated tolerance: none (``torch.equal``), against the same optimizer kept on the device.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

import pytest
import torch

import checkpoint
from offload_fsdp import HybridDeviceOptimizer, OffloadOptions
from offload_fsdp import state_only as state_only_module
from offload_fsdp.grad import local_tensor
from tests.distributed import run_ranks
from tests.fakes.deferred_queues import DeferredQueues
from tests.test_offload_distributed import _model as _fsdp_model  # rows 5, 3, 2, 1: uneven and empty shards
from tests.test_offload_distributed import _shard as _fsdp

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # one-process checkpoints
]


@dataclass
class _Counter:
    """Device bytes alive (allocated by the emulated device, not yet freed) and their peak.

    A buffer is freed when its memory is (the last tensor or view of its storage dropped), as a real
    allocator frees it, not when the tensor object the device handed out is: ``.data`` and views
    alias the same memory under other tensor objects.
    """

    live: int = 0
    peak: int = 0
    queues: list[DeferredQueues] = field(default_factory=list)
    """the emulated device's copy queues, one per parking made"""

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty(like.shape, dtype=like.dtype)
        size = out.numel() * out.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(out.untyped_storage(), self._free, size)
        return out

    def _free(self, size: int) -> None:
        self.live -= size


@dataclass(frozen=True)
class _EmulatedDevice(state_only_module.ParkingDevice):
    counter: _Counter = field(default_factory=_Counter)

    def device_like(self, t: torch.Tensor) -> torch.Tensor:
        return self.counter.allocate(t)


@pytest.fixture
def emulated(monkeypatch) -> _Counter:
    """Every state-only optimizer built in the test parks through one emulated device; its byte counter."""
    counter = _Counter()

    def parking_device_for(device: torch.device) -> _EmulatedDevice:
        counter.queues.append(DeferredQueues())
        return _EmulatedDevice(device, counter.queues[-1], pin=False, counter=counter)

    monkeypatch.setattr(state_only_module, "parking_device_for", parking_device_for)
    return counter


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # params of 48, 6, 36, 6, 12 and 2 elements: two buckets at bucket_numel=60 (54 and 56 elements)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)
    ).to(dtype)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=0.1),
}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _build(name, dtype, *, fraction=0.0, seed=0, **options):
    model = _model(dtype, seed)
    opt = HybridDeviceOptimizer(OPTIMIZERS[name](model.parameters()), fraction, bucket_numel=60, **options)
    return model, opt


def _train(model, opt, start, stop, *, sched=None, write=False):
    dtype = next(model.parameters()).dtype
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(4, 8, generator=gen).to(dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if write and step == start:  # a weight written between steps is the truth (the master follows it)
            with torch.no_grad():
                next(model.parameters()).mul_(0.5)


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), f"{name} differs"


def _assert_same_state(a: HybridDeviceOptimizer, b: HybridDeviceOptimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys(), k
        for n in sa[k]:
            x, y = sa[k][n], sb[k][n]
            # state-only offload keeps its state on the host between steps; the reference may hold it on a device
            assert torch.equal(torch.as_tensor(x).cpu(), torch.as_tensor(y).cpu()), f"param {k} state {n} differs"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fraction", [0.0, 0.5], ids=["all state-only", "half host-updated"])
def test_state_only_is_bit_identical_to_the_same_optimizer_kept_on_the_device(emulated, name, dtype, fraction):
    ref, ref_opt = _build(name, dtype, fraction=fraction)
    model, opt = _build(name, dtype, fraction=fraction, offload_state_only=True)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref_opt, opt)]
    _train(ref, ref_opt, 0, 5, sched=scheds[0], write=True)
    _train(model, opt, 0, 5, sched=scheds[1], write=True)
    _assert_same_params(ref, model)
    _assert_same_state(ref_opt, opt)
    assert emulated.peak > 0, "nothing was fetched to the (emulated) device"


def test_with_no_host_share_it_matches_plain_torch_adamw_and_state_reads_right_after_wait_for_params(emulated):
    ref = _model(torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = _build("adamw", torch.float32, offload_state_only=True)
    _train(ref, ref_opt, 0, 4)
    _train(model, opt, 0, 4)
    _assert_same_params(ref, model)
    # optimizer.state between steps: valid once the write-backs landed (the emulated device shows NaN before)
    opt.wait_for_params()
    for p, q in zip(ref.parameters(), model.parameters()):
        for n in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_opt.state[p][n], opt.state[q][n])


def _one_bucket_budget(name: str = "adamw") -> int:
    """Room for the larger bucket alone: its host bytes once its state exists (``layout()``), as a budget."""
    probe, probe_opt = _build(name, torch.bfloat16, offload_state_only=True)
    _train(probe, probe_opt, 0, 1)
    # buckets at bucket_numel=60: (0.weight, 0.bias: 54 elements), (2.*, 4.*: 56), each of fp32 master +
    # moments (+ the fused class's step scalars), 64-byte aligned in one host allocation
    sizes = [b.host_bytes for b in probe_opt.layout().state_only_buckets]
    assert len(sizes) == 2 and sum(sizes) > max(sizes) >= 12 * 56
    return max(sizes)


@pytest.mark.parametrize("bounded", [False, True], ids=["no budget", "one bucket's budget"])
def test_a_bucket_is_fetched_during_backward_as_its_grads_become_final_within_the_budget(emulated, bounded):
    budget = _one_bucket_budget() if bounded else None
    model, opt = _build("adamw", torch.bfloat16, offload_state_only=True, state_device_bytes=budget)
    h2d = emulated.queues[-1].h2d_lane
    marks: list[int] = []  # H2D copies queued so far, at each step()'s start and end
    opt.register_step_pre_hook(lambda *_: marks.append(h2d.queued))
    opt.register_step_post_hook(lambda *_: marks.append(h2d.queued))
    _train(model, opt, 0, 3)
    in_backward = [marks[0]] + [marks[i] - marks[i - 1] for i in range(2, len(marks), 2)]
    in_step = [marks[i + 1] - marks[i] for i in range(0, len(marks), 2)]
    # the first backward fetches nothing (no size measured yet); later backwards fetch both buckets, or,
    # within one bucket's budget, one (step() the other)
    assert in_backward == ([0, 2, 2] if budget is None else [0, 1, 1])
    assert in_step == ([2, 0, 0] if budget is None else [2, 1, 1])


def test_a_param_group_added_later_gets_state_only_buckets_of_its_own_and_stays_bit_identical(emulated):
    runs = []
    for options in ({}, {"offload_state_only": True}):
        model = _model(torch.bfloat16)
        head = model[4]
        opt = HybridDeviceOptimizer(_adamw(list(model[0].parameters()) + list(model[2].parameters())), 0.0,
                                    bucket_numel=60, **options)  # fmt: skip
        _train(model, opt, 0, 2)
        opt.add_param_group({"params": list(head.parameters()), "lr": 3e-2})
        _train(model, opt, 2, 4)
        runs.append((model, opt))
    _assert_same_params(runs[0][0], runs[1][0])
    _assert_same_state(runs[0][1], runs[1][1])


def _scaled_run(**options):
    model, opt = _build("adamw", torch.float32, fraction=0.5, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
        scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()  # step 2 is skipped
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt


def test_a_grad_scaler_loop_with_clipping_and_an_inf_step_stays_bit_identical(emulated):
    ref, ref_opt = _scaled_run()
    model, opt = _scaled_run(offload_state_only=True)
    _assert_same_params(ref, model)
    _assert_same_state(ref_opt, opt)


def test_mixed_with_host_updates_overlapped_with_backward_it_stays_bit_identical(emulated):
    ref, ref_opt = _build("adamw", torch.bfloat16, fraction=0.5, overlap_step_with_backward=True)
    model, opt = _build("adamw", torch.bfloat16, fraction=0.5, overlap_step_with_backward=True, offload_state_only=True)
    _train(ref, ref_opt, 0, 4)
    _train(model, opt, 0, 4)
    _assert_same_params(ref, model)
    _assert_same_state(ref_opt, opt)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw fused"])
def test_device_memory_held_for_state_never_exceeds_the_budget_and_is_freed_after_the_write_back(emulated, fused):
    name = "adamw fused" if fused else "adamw"
    probe, probe_opt = _build(name, torch.bfloat16, offload_state_only=True)
    _train(probe, probe_opt, 0, 2)  # the first update creates the state (torch allocates it, uncounted here)
    unbounded = emulated.peak
    budget = _one_bucket_budget(name)  # room for one bucket at a time
    assert budget < unbounded, "the budget must bind for this test to mean anything"
    emulated.peak = emulated.live = 0
    ref, ref_opt = _build(name, torch.bfloat16)
    model, opt = _build(name, torch.bfloat16, offload_state_only=True, state_device_bytes=budget)
    _train(ref, ref_opt, 0, 4)
    _train(model, opt, 0, 1)
    # A bucket's first update runs with nothing else of it on the device (its size is unknown before; checked
    # after): from then on every fetch is counted here, by the emulated device's allocator
    emulated.peak = emulated.live
    _train(model, opt, 1, 4)
    _assert_same_params(ref, model)
    assert 0 < emulated.peak <= budget
    opt.state_dict()  # waits for the write-backs in flight: nothing is left on the device
    assert emulated.live == 0


@pytest.mark.parametrize("bounded", [False, True], ids=["no budget", "one bucket's budget"])
def test_between_steps_no_device_memory_is_held_for_state_once_the_device_ran_the_write_backs(emulated, bounded):
    # Found on an H200: the device buffers a write-back reads stayed allocated until the optimizer next
    # waited on it (the next backward's fetch, or never for an optimizer dropped in a reference cycle),
    # so the next forward ran with the whole state still on the device
    budget = _one_bucket_budget() if bounded else None
    model, opt = _build("adamw", torch.bfloat16, offload_state_only=True, state_device_bytes=budget)
    _train(model, opt, 0, 3)
    for queues in emulated.queues:
        queues.catch_up()  # the device runs its queued D2H during the next forward; the host waits on nothing
    assert emulated.live == 0, f"{emulated.live} device bytes still held for parked state between steps"
    _train(model, opt, 3, 4)  # and the next step fetches it again from the host buffers
    ref, ref_opt = _build("adamw", torch.bfloat16)
    _train(ref, ref_opt, 0, 4)
    _assert_same_params(ref, model)
    _assert_same_state(ref_opt, opt)


def test_a_bucket_parks_in_one_host_allocation_and_moves_in_one_copy_each_way(emulated):
    model, opt = _build("adamw", torch.bfloat16, offload_state_only=True)
    queues = emulated.queues[-1]
    _train(model, opt, 0, 1)  # the first update creates the moments on the device: parked one tensor at a time
    copies = (queues.h2d_lane.queued, queues.d2h_lane.queued)
    _train(model, opt, 1, 3)
    buckets = opt.layout().state_only_buckets
    assert (queues.h2d_lane.queued - copies[0], queues.d2h_lane.queued - copies[1]) == (2 * len(buckets),) * 2
    opt.wait_for_params()
    for b in buckets:  # masters and both moments of each param, in the bucket's one allocation
        names = set(b.params)
        storages = {
            t.untyped_storage().data_ptr()
            for r, p in zip(opt.layout().params, model.parameters())
            if r.name in names
            for t in opt.state[p].values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        }
        assert len(storages) == 1, f"bucket {b.index}: {len(storages)} host allocations"
        assert b.host_bytes >= 12 * b.numel
    ref, ref_opt = _build("adamw", torch.bfloat16)
    _train(ref, ref_opt, 0, 3)
    _assert_same_params(ref, model)
    _assert_same_state(ref_opt, opt)


def test_a_budget_smaller_than_one_bucket_is_a_value_error_naming_both(emulated):
    model, opt = _build("adamw", torch.float32, offload_state_only=True, state_device_bytes=64)
    with pytest.raises(ValueError, match="state_device_bytes=64 is smaller than the optimizer state of one"):
        _train(model, opt, 0, 1)


def test_the_info_construction_line_names_the_state_only_share_and_its_budget(emulated, caplog):
    with caplog.at_level("INFO", logger="offload_fsdp.optimizer"):
        _build("adamw", torch.bfloat16, offload_state_only=True, state_device_bytes=4096)
    assert "device share state-only: 2 buckets" in caplog.text and "state_device_bytes=4096" in caplog.text


def test_layout_shows_each_state_only_param_in_its_bucket_and_host_updated_ones_in_theirs(emulated):
    _, opt = _build("adamw", torch.bfloat16, fraction=0.5, offload_state_only=True)
    layout = opt.layout()
    for p in layout.params:
        assert (p.bucket is None) == (p.state_only_bucket is not None), f"{p.name}: host-updated or state-only"
    assert any(p.offloaded for p in layout.params) and layout.state_only_buckets, "half and half at fraction 0.5"
    by_name = {p.name: p for p in layout.params}
    assert [n for b in layout.state_only_buckets for n in b.params] == [
        p.name for p in layout.params if p.state_only_bucket is not None
    ]
    for b in layout.state_only_buckets:
        assert all(by_name[n].state_only_bucket == b.index for n in b.params)
        assert 0 < b.numel <= 60 and b.device == torch.device("cpu") and not b.pinned
    _, plain = _build("adamw", torch.bfloat16, fraction=0.5)  # without state-only offload: none
    assert plain.layout().state_only_buckets == () and all(p.state_only_bucket is None for p in plain.layout().params)


def test_state_only_with_the_default_offload_fraction_of_one_warns_that_nothing_is_state_only():
    with pytest.warns(UserWarning, match="pass offload_fraction=0.0 to keep every update on the device"):
        HybridDeviceOptimizer([torch.nn.Parameter(torch.ones(3))], lr=0.1, offload_state_only=True)


def test_state_device_bytes_without_state_only_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="set offload_state_only=True or drop state_device_bytes"):
        OffloadOptions(state_device_bytes=1 << 20)
    with pytest.raises(ValueError, match="state_device_bytes must be None or an int"):
        OffloadOptions(offload_state_only=True, state_device_bytes=-1)


def test_materialize_state_makes_fresh_state_and_the_run_stays_bit_identical(emulated):
    ref, ref_opt = _build("adamw", torch.bfloat16)
    model, opt = _build("adamw", torch.bfloat16, offload_state_only=True)
    for o in (ref_opt, opt):
        o.materialize_state()
    _assert_same_state(ref_opt, opt)
    _train(ref, ref_opt, 0, 3)
    _train(model, opt, 0, 3)
    _assert_same_params(ref, model)
    _assert_same_state(ref_opt, opt)


MODES = {
    "host": {"fraction": 1.0},
    "device": {"fraction": 0.0},
    "state-only": {"fraction": 0.0, "offload_state_only": True},
    "mixed": {"fraction": 0.5, "offload_state_only": True},
}
KEPT_ON_DEVICE = {"state-only": "device", "mixed": "half"}  # the same optimizer without state-only offload
MODES["half"] = {"fraction": 0.5}


def _resume(tmp_path, saved: str, loaded: str):
    model, opt = _build("adamw", torch.bfloat16, **MODES[saved])
    _train(model, opt, 0, 3)
    checkpoint.save(tmp_path / f"{saved}-{loaded}", model=model, optimizer=opt)
    fresh, fresh_opt = _build("adamw", torch.bfloat16, seed=7, **MODES[loaded])  # other weights: all from the load
    checkpoint.load(tmp_path / f"{saved}-{loaded}", model=fresh, optimizer=fresh_opt)
    _train(fresh, fresh_opt, 3, 5)
    return fresh, fresh_opt


@pytest.mark.parametrize(
    "saved, loaded",
    [("host", "state-only"), ("state-only", "host"), ("device", "state-only"), ("state-only", "device"),
     ("mixed", "mixed"), ("state-only", "mixed"), ("mixed", "host")],
)  # fmt: skip
def test_resume_from_a_checkpoint_saved_in_another_mode_is_bit_exact(emulated, tmp_path, saved, loaded):
    # The reference takes the same path with the device share kept on the device (the host kernel and
    # torch's foreach AdamW may round differently: each mode is compared with its own kind)
    ref, ref_opt = _resume(tmp_path, KEPT_ON_DEVICE.get(saved, saved), KEPT_ON_DEVICE.get(loaded, loaded))
    fresh, fresh_opt = _resume(tmp_path, saved, loaded)
    _assert_same_params(ref, fresh)
    _assert_same_state(ref_opt, fresh_opt)


# ------------------------------------------------------------------ FSDP2, 3 ranks (uneven and empty shards)


def _fsdp_train(model, opt, rank, start, stop):
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(100 * step + rank)
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _fsdp_body(rank: int, world_size: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    counter = _Counter()
    state_only_module.parking_device_for = lambda device: _EmulatedDevice(  # this rank's process only
        device, DeferredQueues(), pin=False, counter=counter
    )
    out: dict = {}
    for fraction in (0.0, 0.5):
        # the reference: plain AdamW (fraction 0), else the same fraction with the device share kept on the device
        ref = _fsdp(_fsdp_model(), mesh)
        ref_opt = _adamw(ref.parameters()) if fraction == 0 else HybridDeviceOptimizer(_adamw(ref.parameters()), 0.5)
        _fsdp_train(ref, ref_opt, rank, 0, 3)
        out["empty"] = sum(p.to_local().numel() == 0 for p in ref.parameters())
        model = _fsdp(_fsdp_model(), mesh)
        opt = HybridDeviceOptimizer(_adamw(model.parameters()), fraction, offload_state_only=True)
        _fsdp_train(model, opt, rank, 0, 2)
        checkpoint.save(f"{tmp}/f{fraction}", model=model, optimizer=opt)  # loaded in the host mode below
        saved = [(p.to_local().clone(), {n: local_tensor(t).clone() for n, t in opt.state[p].items()})
                 for p in model.parameters()]  # fmt: skip
        full = [(p.full_tensor(), {n: _full(t) for n, t in opt.state[p].items()}) for p in model.parameters()]
        if rank == 0:
            out[f"full_{fraction}"] = full  # what a load at another world size must find
        _fsdp_train(model, opt, rank, 2, 3)
        after_step_3 = [p.to_local().clone() for p in model.parameters()]
        for o in (opt, ref_opt):
            o.state_dict()  # optimizer.state is read below: the write-backs must have landed
        out[f"exact_{fraction}"] = all(
            torch.equal(a.to_local(), b.to_local()) for a, b in zip(ref.parameters(), model.parameters())
        ) and all(
            torch.equal(ref_opt.state[p][n].to_local(), opt.state[q][n].to_local())
            for p, q in zip(ref.parameters(), model.parameters()) for n in ("exp_avg", "exp_avg_sq")
        )  # fmt: skip
        for mode, options in (("host", {}), ("state-only", {"offload_state_only": True})):
            resumed = _fsdp(_fsdp_model(seed=7), mesh)
            resumed_opt = HybridDeviceOptimizer(_adamw(resumed.parameters()), 1.0 if mode == "host" else fraction,
                                                **options)  # fmt: skip
            _fsdp_train(resumed, resumed_opt, rank, 5, 6)  # a running optimizer: its state was on the device once
            checkpoint.load(f"{tmp}/f{fraction}", model=resumed, optimizer=resumed_opt)  # in place (DTensor views)
            resumed_opt.wait_for_params()
            out[f"resumed_{mode}_{fraction}"] = all(
                torch.equal(p.to_local(), weight)
                and all(torch.equal(local_tensor(resumed_opt.state[p][n]), t) for n, t in state.items())
                for p, (weight, state) in zip(resumed.parameters(), saved)
            )
            if mode == "state-only":  # the same mode continues exactly as the run that saved
                _fsdp_train(resumed, resumed_opt, rank, 2, 3)
                out[f"continued_{fraction}"] = all(
                    torch.equal(p.to_local(), w) for p, w in zip(resumed.parameters(), after_step_3)
                )
    out["peak"] = counter.peak
    return out


@pytest.mark.slow
def test_fsdp2_on_three_ranks_is_bit_identical_and_its_checkpoints_load_in_place_in_both_modes_and_in_one_process(
    emulated, tmp_path
):
    results = run_ranks(_fsdp_body, 3, args=(str(tmp_path),))
    assert any(r["empty"] for r in results), "no rank had an empty shard"
    for rank, r in enumerate(results):
        for fraction in (0.0, 0.5):
            assert r[f"exact_{fraction}"], f"rank {rank}, fraction {fraction}: not bit-identical"
            assert r[f"continued_{fraction}"], f"rank {rank}, fraction {fraction}: the resumed run differs"
            for mode in ("host", "state-only"):
                assert r[f"resumed_{mode}_{fraction}"], f"rank {rank}, fraction {fraction}: {mode} loaded other values"
        assert r["peak"] > 0
    # resharded: the 3-rank checkpoints into one process, state-only again (other buckets too)
    for fraction in (0.0, 0.5):
        model = _fsdp_model(seed=7)
        opt = HybridDeviceOptimizer(_adamw(model.parameters()), fraction, offload_state_only=True, bucket_numel=20)
        checkpoint.load(tmp_path / f"f{fraction}", model=model, optimizer=opt)
        opt.wait_for_params()  # optimizer.state read below
        for p, (weight, state) in zip(model.parameters(), results[0][f"full_{fraction}"]):
            assert torch.equal(p, weight)
            assert opt.state[p].keys() == state.keys()
            for n, t in state.items():
                assert torch.equal(opt.state[p][n], t), f"fraction {fraction}: {n} not resharded exactly"


# ------------------------------------------------------------------ on a real accelerator


def _device_run(device, fused: bool, steps: int, *, wait: bool = True, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(device, torch.bfloat16)
    # one layer (65,792 elements) per bucket
    opt = HybridDeviceOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused), 0.0, bucket_numel=70_000, **options
    )
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 256, generator=gen).to(device, torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    if wait:
        opt.wait_for_params()
    return model, opt


@pytest.mark.accelerator
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw fused"])
def test_on_a_device_it_is_bit_identical_and_its_state_leaves_the_device_between_steps(fused):
    device = torch.accelerator.current_accelerator()
    ref, ref_opt = _device_run(device, fused, 4)
    held_by_ref = torch.accelerator.memory_allocated(device)
    model, opt = _device_run(device, fused, 4, offload_state_only=True, state_device_bytes=2 * 65_792 * 12 + 64)
    _assert_same_params(ref, model)
    _assert_same_state(ref_opt, opt)
    for state in opt.state.values():
        for name, t in state.items():
            if t.dim() > 0 or fused:
                assert t.device.type == "cpu" and t.is_pinned(), f"{name} stays on the device between steps"
    state_bytes = sum(p.numel() for p in model.parameters()) * 12  # fp32 master + two fp32 moments
    assert opt.pinned_bytes >= state_bytes
    del ref, ref_opt
    gc.collect()  # the reference optimizer's hooks hold it in cycles
    assert held_by_ref - torch.accelerator.memory_allocated(device) >= 0.9 * state_bytes


@pytest.mark.accelerator
@pytest.mark.parametrize("budget", [None, 2 * 65_792 * 12 + 64], ids=["no budget", "two buckets' budget"])
def test_on_a_device_no_state_stays_allocated_between_steps_though_nothing_waited_on_the_write_backs(budget):
    device = torch.accelerator.current_accelerator()
    _device_run(device, False, 1)  # warm-up: what the process allocates once (cuBLAS workspaces, ...)
    gc.collect()  # the warm-up's optimizer and model, held in reference cycles
    base = torch.accelerator.memory_allocated(device)
    model, opt = _device_run(device, False, 3, wait=False, offload_state_only=True, state_device_bytes=budget)
    torch.accelerator.synchronize(device)  # idle, as during the next forward; the optimizer waited on nothing
    held = torch.accelerator.memory_allocated(device) - base
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # grads are None after zero_grad()
    state_bytes = sum(p.numel() for p in model.parameters()) * 12  # fp32 master + two fp32 moments
    assert held - params < 0.1 * state_bytes, f"{held - params} device bytes beyond the params ({state_bytes} of state)"
