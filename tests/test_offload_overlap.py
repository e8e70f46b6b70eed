"""overlap_step_with_backward=True: host updates during the final backward, bit-identical to the default mode.

Every parity test trains the same model twice, default mode and overlapped mode,
and compares the params bit for bit; it also checks the default mode against plain
torch (close: the host path's fused kernel may round differently), and that the
overlapped run really started updates during backward (else it would compare the
default mode with itself).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import checkpoint
import optim
from offload_fsdp import HybridDeviceOptimizer, transfer
from offload_fsdp.copy_engine import SyncCopyEngine
from offload_fsdp.forward_waits import owners_of_buckets
from offload_fsdp.host_kernels import AdamKernel, register_host_kernel
from offload_fsdp.per_element import PER_ELEMENT_OPTIMIZERS, qualified_name
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.transfer_ring import RingCopyEngine
from tests.distributed import run_ranks
from tests.fakes.deferred_queues import DeferredQueues

WIDTH = 8
CONFIGS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),  # the delegate path
}


class _Net(torch.nn.Module):
    """Linear layers; ``tied`` reuses the first weight in the last layer; ``branch`` gets a grad on even steps only."""

    def __init__(self, layers: int, width: int, dtype: torch.dtype, tied: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, dtype=dtype) for _ in range(layers))
        if tied:
            self.layers[-1].weight = self.layers[0].weight
        self.branch = torch.nn.Linear(width, width, dtype=dtype)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if step % 2 == 0:
            x = x + self.branch(x)
        return x


def _net(layers=6, width=WIDTH, dtype=torch.float32, tied=False) -> _Net:
    torch.manual_seed(0)
    return _Net(layers, width, dtype, tied)


def _batch(step: int, micro: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, width, generator=torch.Generator().manual_seed(100 * step + micro)).to(dtype)


_WORKER = "offload_fsdp-host-step"
_KERNEL_THREADS: list[str] = []
"""the thread each host kernel call of the current step ran on (recorded through register_host_kernel)"""


def _recording(factory):
    def make():
        kernel = factory()
        step_bucket = kernel.step_bucket

        def recorded(*args):
            _KERNEL_THREADS.append(threading.current_thread().name)
            step_bucket(*args)

        kernel.step_bucket = recorded
        return kernel

    return make


@pytest.fixture(autouse=True)
def _record_kernel_threads():
    """AdamW's and SGD's host kernels, each call recorded with its thread (the public extension point)."""
    originals = {cls: PER_ELEMENT_OPTIMIZERS[qualified_name(cls)] for cls in (torch.optim.AdamW, torch.optim.SGD)}
    for cls, factory in originals.items():
        register_host_kernel(cls, _recording(factory))
    yield
    for cls, factory in originals.items():
        PER_ELEMENT_OPTIMIZERS[qualified_name(cls)] = factory


def _train(model, opt, steps, *, micro_batches=1, sched=None, dtype=torch.float32, width=WIDTH, seen=None):
    """Train; ``seen`` collects, per step, whether a host update ran on the worker (queued during backward)."""
    for step in range(steps):
        _KERNEL_THREADS.clear()
        for micro in range(micro_batches):
            final = micro == micro_batches - 1
            ctx = opt.defer_grad_copies() if not final else _nullcontext()
            with ctx:
                model(_batch(step, micro, width, dtype), step).float().square().mean().backward()
        opt.step()
        if seen is not None:
            seen.append(_WORKER in _KERNEL_THREADS)
        if sched is not None:
            sched.step()
        opt.zero_grad()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _run(name, fraction, dtype, overlap, *, steps=3, micro_batches=1, sched=False, tied=False, layers=6, **kw):
    cls, hyper = CONFIGS[name]
    model = _net(layers=layers, dtype=dtype, tied=tied)
    opt = HybridDeviceOptimizer(
        model.named_parameters(), fraction, cpu_optimizer_cls=cls, overlap_step_with_backward=overlap, **hyper, **kw
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if sched else None
    seen: list[bool] = []
    _train(model, opt, steps, micro_batches=micro_batches, sched=scheduler, dtype=dtype, seen=seen)
    return model, opt, seen


def _assert_identical(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs between the default and the overlapped mode"


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_overlapped_steps_are_bit_identical_to_the_default_mode(name, dtype, fraction):
    default, _, _ = _run(name, fraction, dtype, False, bucket_numel=80)
    overlapped, _, seen = _run(name, fraction, dtype, True, bucket_numel=80)
    _assert_identical(default, overlapped)
    assert all(seen), "no host update was queued during backward: the overlapped path did not run"


def test_bf16_moments_with_stochastic_rounding_are_bit_identical_too():
    bf16_state = PrecisionPolicy(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    default, _, _ = _run("adamw", 1.0, torch.bfloat16, False, bucket_numel=80, precision=bf16_state)
    overlapped, _, seen = _run("adamw", 1.0, torch.bfloat16, True, bucket_numel=80, precision=bf16_state)
    _assert_identical(default, overlapped)
    assert all(seen)


def test_the_default_mode_being_compared_matches_plain_torch():
    ours, _, _ = _run("adamw", 1.0, torch.float32, True, bucket_numel=80)
    ref = _net()
    cls, hyper = CONFIGS["adamw"]
    _train(ref, cls(ref.parameters(), **hyper), 3)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradient_accumulation_with_deferred_copies_and_a_scheduler_is_bit_identical(name):
    default, _, _ = _run(name, 0.5, torch.float32, False, micro_batches=3, sched=True, steps=4, bucket_numel=80)
    overlapped, opt, seen = _run(name, 0.5, torch.float32, True, micro_batches=3, sched=True, steps=4, bucket_numel=80)
    _assert_identical(default, overlapped)
    assert all(seen)
    assert opt.param_groups[0]["lr"] == CONFIGS[name][1]["lr"] * 0.5**4


def test_tied_weights_are_updated_once_with_their_whole_gradient():
    default, _, _ = _run("adamw", 1.0, torch.float32, False, tied=True, bucket_numel=70)
    overlapped, _, seen = _run("adamw", 1.0, torch.float32, True, tied=True, bucket_numel=70)
    _assert_identical(default, overlapped)
    assert all(seen)


def test_params_without_a_grad_in_some_steps_wait_for_step_and_match():
    # bucket_numel 144 puts `branch` (grad on even steps only) in a bucket with the last layer's params
    default, _, _ = _run("adamw", 1.0, torch.float32, False, steps=4, layers=5, bucket_numel=144)
    overlapped, opt, _ = _run("adamw", 1.0, torch.float32, True, steps=4, layers=5, bucket_numel=144)
    _assert_identical(default, overlapped)
    assert any(any(n.startswith("branch") for n in b.params) and len(b.params) > 2 for b in opt.layout().buckets)


def test_many_tiny_buckets_race_nothing_over_several_steps():
    # 40 low-arithmetic-intensity layers, 4 params per bucket: the worker runs while backward goes on
    kw = dict(layers=40, steps=5, bucket_numel=20)
    default, _, _ = _run("adamw", 1.0, torch.bfloat16, False, **kw)
    overlapped, opt, seen = _run("adamw", 1.0, torch.bfloat16, True, **kw)
    _assert_identical(default, overlapped)
    assert all(seen) and len(opt.layout().buckets) >= 40


def test_updates_are_queued_during_backward_in_gradient_arrival_order():
    model = _net()
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=True
    )
    order: list[int] = []
    # Private: the order jobs reach the host worker is visible to no public call (only their results are).
    worker = opt._schedule.overlapped.worker
    submit = worker.submit
    worker.submit = lambda what, fn: (order.append(int(what.split()[1])), submit(what, fn))
    started_before_first_layer: list[bool] = []
    model.layers[0].register_full_backward_pre_hook(lambda *_: started_before_first_layer.append(opt.step_in_progress))
    model(_batch(1, 0, WIDTH, torch.float32), 1).square().mean().backward()
    assert started_before_first_layer == [True]
    assert order == sorted(order, reverse=True), "the last layers' grads arrive first"
    opt.step()


class _RecordingEngine(SyncCopyEngine):
    """Synchronous copies, plus a log of every call with the bucket and the calling thread."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int | None, str]] = []

    def _note(self, what: str, bucket=None) -> None:
        self.log.append((what, None if bucket is None else bucket.index, threading.current_thread().name))

    def begin_step(self):
        self._note("begin")

    def note_params_read(self):
        self._note("mark")

    def stage_grad(self, bucket, dst, src):
        self._note("stage", bucket)
        super().stage_grad(bucket, dst, src)

    def wait_grads(self, bucket):
        self._note("wait_grads", bucket)

    def push_params(self, bucket, pairs):
        self._note("push", bucket)
        super().push_params(bucket, pairs)

    def end_step(self, main_waits=True):
        self._note("end")


def test_each_push_follows_a_read_mark_taken_after_its_params_last_read_and_end_step_follows_all(monkeypatch):
    # What a device stream needs: the H2D of a bucket may overwrite its params only once the main
    # stream has queued every read of them (a mark after the bucket's last grad when it starts
    # during backward, else one in step()), and end_step (the next forward's wait) comes last.
    model = _net(layers=5)  # buckets of 144: (layers 0, 1), (2, 3), (4, branch); branch: even steps only
    engine = _RecordingEngine()
    monkeypatch.setattr(transfer, "copy_engine_for", lambda device, **_: engine)  # the one place engines are made
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, lr=0.01, bucket_numel=144, overlap_step_with_backward=True
    )
    opt.register_step_pre_hook(lambda *_: engine._note("step()"))
    for step in range(2):
        engine.log.clear()
        model(_batch(step, 0, WIDTH, torch.float32), step).square().mean().backward()
        opt.step()
        opt.zero_grad()
        log, kinds = engine.log, [k for k, _, _ in engine.log]
        assert kinds.count("begin") == 1 and kinds.count("end") == 1 and kinds[-1] == "end"
        assert kinds.index("begin") < kinds.index("push")
        step_call = kinds.index("step()")
        pushes = [(i, b, t) for i, (k, b, t) in enumerate(log) if k == "push"]
        assert sorted(b for _, b, _ in pushes) == [0, 1, 2]
        for i, bucket, thread in pushes:
            last_stage = max(j for j, (k, b, _) in enumerate(log) if k == "stage" and b == bucket)
            # params are written by step() only (backward may read a param after its grad is final),
            # after a read mark taken once step() began
            assert thread == "MainThread" and i > step_call, f"bucket {bucket} was written during backward"
            assert any(k in ("begin", "mark") for k, _, _ in log[step_call + 1 : i]), (
                f"step {step}: bucket {bucket}'s H2D is not ordered after its params' last read"
            )
            assert any(k == "wait_grads" and b == bucket for k, b, _ in log[last_stage:i]), (
                "the update must wait for its grads"
            )
        on_worker = sorted(b for k, b, t in log if k == "wait_grads" and t == "offload_fsdp-host-step")
        assert on_worker == ([0, 1, 2] if step == 0 else [0, 1])


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("slots", [1, 2])
def test_through_a_ring_of_pinned_slots_on_an_emulated_async_device_it_stays_bit_identical(monkeypatch, name, slots):
    # DeferredQueues: a copy runs only when waited on and its destination reads NaN until then, so a
    # host step reading grads before their D2H landed, or a param read before its H2D, shows up.
    engines: list[RingCopyEngine] = []

    def engine_for(device, *, transfer_slots):
        engines.append(RingCopyEngine(device, slots, queues=DeferredQueues(), pin=False))
        return engines[-1]

    default, _, _ = _run(name, 0.5, torch.float32, False, micro_batches=2, sched=True, bucket_numel=80)
    with monkeypatch.context() as m:
        m.setattr(transfer, "copy_engine_for", engine_for)
        overlapped, opt, seen = _run(
            name, 0.5, torch.float32, True, micro_batches=2, sched=True, bucket_numel=80, pinned_transfer_slots=slots
        )
    _assert_identical(default, overlapped)
    assert all(seen) and len(engines) == 1 and {b.copy_engine for b in opt.layout().buckets} == {"RingCopyEngine"}
    assert engines[0].d2h_ring.peak_in_use <= slots and engines[0].h2d_ring.peak_in_use <= slots


# ---------------------------------------------------------------------------------------- refusals


def _opt_after_backward(**kw):
    model = _net()
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=True, **kw
    )
    model(_batch(0, 0, WIDTH, torch.float32), 1).square().mean().backward()
    return model, opt


def test_step_with_a_closure_is_refused():
    model, opt = _opt_after_backward()
    with pytest.raises(ValueError, match="step\\(closure\\) is not supported"):
        opt.step(lambda: torch.tensor(0.0))


def test_optim_clip_grad_norm_and_grad_norm_refuse_params_of_an_overlapped_optimizer():
    model, opt = _opt_after_backward()
    with pytest.raises(ValueError, match="optim.clip_grad_norm_ was given parameter 'layers.0.weight' .*overlap_step"):
        optim.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="optim.grad_norm .*overlap_step_with_backward"):
        optim.grad_norm(list(model.parameters()))
    opt.step()
    plain = _net()
    plain.layers[0].weight.grad = torch.ones_like(plain.layers[0].weight)
    assert optim.grad_norm(plain.parameters()) > 0  # other params are not refused


def test_torch_clipping_after_backward_makes_step_raise_naming_the_param(monkeypatch):
    model, opt = _opt_after_backward()
    ended: list[bool] = []
    monkeypatch.setattr(SyncCopyEngine, "end_step", lambda self, main_waits=True: ended.append(main_waits))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # scales in place, by 1.0: still refused
    with pytest.raises(ValueError, match="gradient of parameter 'layers.5.weight' was changed in place"):
        opt.step()
    assert ended == [True], "the engine begun during backward must end (the next forward waits for its H2D)"
    opt.zero_grad()  # the optimizer is idle again


def test_grad_scaler_step_is_refused():
    model = _net()
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=True
    )
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(_batch(0, 0, WIDTH, torch.float32), 1).square().mean()).backward()
    with pytest.raises(ValueError, match="GradScaler.step is not supported"):
        scaler.step(opt)


def test_a_second_backward_reaching_a_started_bucket_raises_from_backward():
    model, opt = _opt_after_backward()
    with pytest.raises(RuntimeError, match="received a gradient in another backward .*defer_grad_copies"):
        model(_batch(0, 1, WIDTH, torch.float32), 1).square().mean().backward()


def test_a_scheduler_stepped_between_backward_and_step_raises():
    model = _net()
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=True
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(_batch(0, 0, WIDTH, torch.float32), 1).square().mean().backward()
    sched.step()
    with pytest.raises(ValueError, match="param group 0: hyper-parameters \\['lr'\\] changed"):
        opt.step()


def test_zero_grad_and_state_dict_between_backward_and_step_raise():
    model, opt = _opt_after_backward()
    for call in (opt.zero_grad, opt.state_dict):
        with pytest.raises(RuntimeError, match="call optimizer.step\\(\\) first"):
            call()
    opt.step()
    opt.zero_grad()


def test_overlap_without_backward_hooks_is_refused():
    with pytest.raises(ValueError, match="needs overlap_cpu_optimizer_d2h_h2d=True"):
        HybridDeviceOptimizer(
            _net().parameters(), 1.0, overlap_cpu_optimizer_d2h_h2d=False, overlap_step_with_backward=True
        )


class _FailingAdamW(AdamKernel):
    """AdamW's host kernel, failing on bucket 0 while ``error`` is set (the last bucket of backward: no hook
    runs after it is queued to raise first, so the failure cannot race the rest of that backward)."""

    error: BaseException | None = None

    def __init__(self) -> None:
        super().__init__(decoupled_default=True)

    def step_bucket(self, bucket, active, group, scratch):
        if _FailingAdamW.error is not None and bucket.index == 0:
            raise _FailingAdamW.error
        super().step_bucket(bucket, active, group, scratch)


@pytest.fixture
def failing_kernel():
    """AdamW's buckets stepped by :class:`_FailingAdamW`, through the public extension point."""
    original = PER_ELEMENT_OPTIMIZERS[qualified_name(torch.optim.AdamW)]
    register_host_kernel(torch.optim.AdamW, _FailingAdamW)
    yield _FailingAdamW
    _FailingAdamW.error = None
    PER_ELEMENT_OPTIMIZERS[qualified_name(torch.optim.AdamW)] = original


def test_an_error_in_the_worker_surfaces_at_step_naming_the_bucket_and_params(failing_kernel):
    model = _net()
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=True
    )
    failing_kernel.error = OSError("disk on fire")
    model(_batch(0, 0, WIDTH, torch.float32), 1).square().mean().backward()
    with pytest.raises(RuntimeError, match="bucket 0 \\(params 'layers.0.weight'.*disk on fire") as info:
        opt.step()
    assert isinstance(info.value.__cause__, OSError)
    failing_kernel.error = None
    opt.zero_grad()  # the failed step is over: the optimizer can go on
    model(_batch(1, 0, WIDTH, torch.float32), 1).square().mean().backward()
    opt.step()


def test_a_worker_error_also_surfaces_at_the_next_hook(failing_kernel):
    model = _net()
    opt = HybridDeviceOptimizer(
        model.named_parameters(), 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=True
    )
    failing_kernel.error = MemoryError("host out of memory")
    model(_batch(0, 0, WIDTH, torch.float32), 1).square().mean().backward()
    # Private: no public call waits for the worker without also raising its failure (which is the point here).
    opt._schedule.overlapped.worker.wait_quietly()  # the failure is recorded: deterministic from here on
    with pytest.raises(RuntimeError, match="bucket 0 \\(params 'layers.0.weight'.*MemoryError"):
        model(_batch(0, 1, WIDTH, torch.float32), 1).square().mean().backward()
    with pytest.raises(RuntimeError, match="bucket 0 .*host out of memory"):  # and step() still says so
        opt.step()


def test_the_worker_thread_ends_with_its_optimizer():
    before = set(threading.enumerate())
    model, opt = _opt_after_backward()
    opt.step()
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "offload_fsdp-host-step"]
    assert thread.is_alive()
    del opt
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
    model(_batch(1, 0, WIDTH, torch.float32), 1).square().mean().backward()
    assert optim.grad_norm(model.parameters()) > 0  # no optimizer updates them during backward any more


# -------------------------------------------------------------------------------------- model=


def test_model_hooks_wait_for_each_modules_own_buckets_right_before_its_forward(monkeypatch):
    model = _net(layers=3, tied=True)  # layers.2.weight is layers.0.weight
    opt = HybridDeviceOptimizer(model.named_parameters(), 1.0, lr=0.01, bucket_numel=72, model=model)
    owned = {name: sorted(b.index for b in bs) for name, bs in _named_owners(model, opt)}
    # buckets: 0 = layers.0 (72), 1 = layers.1, 2 = layers.2.bias + branch.weight, 3 = branch.bias
    assert owned == {"layers.0": [0], "layers.1": [1], "layers.2": [0, 2], "branch": [2, 3]}
    log: list[tuple[str, object]] = []
    monkeypatch.setattr(SyncCopyEngine, "wait_pushed", lambda self, bucket: log.append(("wait", bucket.index)))
    end_step = SyncCopyEngine.end_step
    monkeypatch.setattr(
        SyncCopyEngine,
        "end_step",
        lambda self, main_waits=True: (log.append(("end_step", main_waits)), end_step(self, main_waits)),
    )
    for name, module in model.named_modules():
        if name in owned:  # registered after ours: runs after our wait
            module.register_forward_pre_hook(lambda m, args, name=name: log.append(("forward", name)))
    forward = [
        ("wait", 0), ("forward", "layers.0"), ("wait", 1), ("forward", "layers.1"),
        ("wait", 0), ("wait", 2), ("forward", "layers.2"), ("wait", 2), ("wait", 3), ("forward", "branch"),
    ]  # fmt: skip
    model(_batch(0, 0, WIDTH, torch.float32), 0).square().mean().backward()
    opt.step()
    assert log == [*forward, ("end_step", False)]  # the step itself leaves the waiting to the forwards
    log.clear()
    model(_batch(1, 0, WIDTH, torch.float32), 0)
    assert log == forward


def _named_owners(model, opt):
    """(module name, the buckets of the params it registers): the owners without FSDP2 (forward_waits)."""
    layout = opt.layout()
    params = [p for group in opt.param_groups for p in group["params"]]
    bucket_of = {id(p): placed.bucket for p, placed in zip(params, layout.params)}
    owners: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(name, set()).add(bucket_of[id(p)])
    return [(n, [b for b in layout.buckets if b.index in bs]) for n, bs in owners.items()]


def test_model_without_an_offloaded_param_is_refused_naming_it():
    model, other = _net(), torch.nn.Linear(3, 3)
    params = [*model.named_parameters(), ("extra.weight", other.weight)]
    with pytest.raises(ValueError, match="parameter 'extra.weight' is offloaded but not a parameter of the model="):
        HybridDeviceOptimizer(params, 1.0, lr=0.01, model=model)
    opt = HybridDeviceOptimizer(model.named_parameters(), 1.0, lr=0.01, model=model)
    before = opt.layout()
    with pytest.raises(ValueError, match="is offloaded but not a parameter of the model="):
        opt.add_param_group({"params": [("extra.weight", other.weight)]})
    assert len(opt.param_groups) == 1 and opt.layout() == before
    assert not other.weight._post_accumulate_grad_hooks  # no backward hook on the refused param (torch's dict)


def test_model_hooks_keep_results_identical():
    default, _, _ = _run("adamw", 1.0, torch.float32, True, bucket_numel=80)
    hooked = _net()
    opt = HybridDeviceOptimizer(hooked.parameters(), 1.0, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1,
                                bucket_numel=80, overlap_step_with_backward=True, model=hooked)  # fmt: skip
    _train(hooked, opt, 3)
    _assert_identical(default, hooked)


# ------------------------------------------------------------------------------------- checkpoint


def test_checkpoint_round_trip_in_overlapped_mode_equals_the_default_mode(tmp_path):
    results = []
    for overlap in (False, True):
        model, opt, _ = _run("adamw", 1.0, torch.bfloat16, overlap, steps=2, bucket_numel=80)
        path = tmp_path / f"ckpt_{overlap}"
        checkpoint.save(str(path), model=model, optimizer=opt)
        fresh = _net(dtype=torch.bfloat16)
        cls, hyper = CONFIGS["adamw"]
        fresh_opt = HybridDeviceOptimizer(
            fresh.parameters(), 1.0, cpu_optimizer_cls=cls, bucket_numel=80, overlap_step_with_backward=overlap,
            **hyper,
        )  # fmt: skip
        checkpoint.load(str(path), model=fresh, optimizer=fresh_opt)
        _train(fresh, fresh_opt, 2, dtype=torch.bfloat16)
        _train(model, opt, 2, dtype=torch.bfloat16)
        _assert_identical(model, fresh)  # resume == uninterrupted
        results.append(fresh)
    _assert_identical(*results)


# ------------------------------------------------------------------------------------------ FSDP2


def _fsdp_body(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for overlap in (False, True):
        torch.manual_seed(0)
        # 5, 3 and 2 rows: uneven shards on 2 and 3 ranks, an empty one on 3
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)
        )
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = HybridDeviceOptimizer(
            model.parameters(), 0.5 if world_size == 3 else 1.0, lr=0.01, weight_decay=0.1, bucket_numel=8,
            overlap_step_with_backward=overlap, model=model if overlap else None,
        )  # fmt: skip
        if overlap:  # model=: the forward pre-hooks sit on the fully_shard units
            # Private: which modules carry the forward waits shows only in timing, not in results.
            assert all(isinstance(m, FSDPModule) for m, _ in owners_of_buckets(model, opt._placement.buckets))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        for step in range(2):
            gen = torch.Generator().manual_seed(100 * step + rank)
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                model(torch.randn(4, 6, generator=gen)).square().mean().backward()
            if overlap:
                assert opt.step_in_progress, "no update started during the final backward"
            opt.step()
            sched.step()
            opt.zero_grad()
        out.append([p.full_tensor() for p in model.parameters()])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_overlapped_steps_are_bit_identical_to_the_default_mode(world_size):
    for default, overlapped in run_ranks(_fsdp_body, world_size):
        for a, b in zip(default, overlapped):
            assert torch.equal(a, b)


def _fsdp_torch_clip_body(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    for i in (0, 2):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=0.01, bucket_numel=8, overlap_step_with_backward=True)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    assert opt.step_in_progress
    # torch's clip scales FSDP2's DTensor grads with _foreach_mul_, which moves no version counter
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(ValueError, match="changed in place or replaced after its overlapped host update") as info:
        opt.step()
    return str(info.value)


def test_fsdp2_grads_clipped_by_torch_after_their_overlapped_update_make_step_raise():
    for message in run_ranks(_fsdp_torch_clip_body, 2):
        assert "gradient clipping" in message


# ------------------------------------------------------------------------------------ accelerator


@pytest.mark.accelerator
def test_on_an_accelerator_one_step_in_flight_is_bit_identical_and_params_land_before_the_next_forward():
    device = torch.accelerator.current_accelerator()
    results = []
    for overlap in (False, True):
        model = _net(layers=24, width=256).to(device)
        opt = HybridDeviceOptimizer(
            model.parameters(),
            1.0,
            lr=0.01,
            bucket_numel=256 * 256 + 256,
            overlap_step_with_backward=overlap,
            model=model if overlap else None,  # per-module waits: the check below covers them too
        )
        for step in range(4):
            x = _batch(step, 0, 256, torch.float32).to(device)
            model(x, step).square().mean().backward()
            if overlap:
                assert opt.step_in_progress
            opt.step()
            opt.zero_grad()
            # One step in flight: this forward is queued while H2D copies may still run; the main
            # stream must wait for them, so it sees the same params as a forward after a full sync.
            with torch.no_grad():
                early = model(x, step + 1)
                torch.accelerator.synchronize()
                assert torch.equal(early, model(x, step + 1)), "a forward read params before their H2D landed"
        torch.accelerator.synchronize()
        results.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_backward_whose_grads_are_zeroed_without_a_step_leaves_no_stale_readiness():
    # Step 0's backward stages branch's grad (its bucket waits for layers.4); the step is skipped
    # (zero_grad). Step 1 has no grad for branch: its bucket must not start from the stale staging.
    results = []
    for overlap in (False, True):
        model = _net(layers=5)
        opt = HybridDeviceOptimizer(
            model.named_parameters(), 1.0, lr=0.01, bucket_numel=144, overlap_step_with_backward=overlap
        )
        with opt.defer_grad_copies():
            model(_batch(0, 0, WIDTH, torch.float32), 0).square().mean().backward()
        opt.zero_grad()  # skipped step, nothing started
        branch_only = model.branch(_batch(0, 1, WIDTH, torch.float32)).square().mean()
        branch_only.backward()  # branch's bucket now has branch counted, layers.4 not
        opt.zero_grad()  # skipped again: branch's count must be forgotten
        model(_batch(1, 0, WIDTH, torch.float32), 1).square().mean().backward()  # odd step: no branch
        opt.step()
        results.append(model)
    _assert_identical(*results)
