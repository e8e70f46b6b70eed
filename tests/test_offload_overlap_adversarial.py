"""An adversarial review of overlap_step_with_backward=True: combinations the main tests do not cover.

Each parity case trains the same model in the default mode and the overlapped mode
and compares the params bit for bit; each also checks that a host update really
was queued during backward in the overlapped run (else it compares the default
mode with itself). Refusals must raise naming the fix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer, Schedule
from offload_fsdp.copy_engine import SyncCopyEngine
from tests.distributed import run_ranks
from tests.test_offload_overlap import WIDTH, _batch, _net

Params = list[torch.Tensor]


def _opt(model: torch.nn.Module, overlap: bool, fraction: float = 1.0, **kw) -> HybridDeviceOptimizer:
    kw.setdefault("lr", 0.01)
    kw.setdefault("bucket_numel", 80)
    return HybridDeviceOptimizer(model.named_parameters(), fraction, overlap_step_with_backward=overlap, **kw)


def _steps(model, opt, steps: int, seen: list[bool], *, first: int = 0, dtype=torch.float32, set_to_none=True):
    for step in range(first, first + steps):
        model(_batch(step, 0, WIDTH, dtype), step).float().square().mean().backward()
        if opt.options.schedule is Schedule.OVERLAPPED:
            seen.append(opt.step_in_progress)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def _graph_safe_grads_kept_and_zeroed(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    _steps(model, _opt(model, overlap, graph_safe_grads=True), 3, seen, set_to_none=False)
    return model


def _graph_safe_grads_in_one_param_buckets(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    # Each bucket starts at its one grad; later grads accumulate into the same flat buffer and must
    # not look like an in-place edit of the started ones (step() refused every step before the fix).
    model = _net()
    _steps(model, _opt(model, overlap, graph_safe_grads=True, bucket_numel=64), 3, seen)
    return model


def _zero_grad_keeping_buffers(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    _steps(model, _opt(model, overlap), 3, seen, set_to_none=False)
    return model


def _fp16_params_with_fp32_masters(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net(dtype=torch.float16)
    _steps(model, _opt(model, overlap), 3, seen, dtype=torch.float16)
    return model


def _frozen_params(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    model.layers[2].weight.requires_grad_(False)
    model.layers[4].bias.requires_grad_(False)
    _steps(model, _opt(model, overlap), 3, seen)
    return model


def _param_group_added_after_two_steps(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("layers.5")]
    opt = HybridDeviceOptimizer(named, 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=overlap)
    _steps(model, opt, 2, seen)
    added = list(model.layers[5].named_parameters(prefix="layers.5"))
    opt.add_param_group({"params": [p for _, p in added], "param_names": [n for n, _ in added], "lr": 0.02})
    _steps(model, opt, 2, seen, first=2)
    return model


def _load_state_dict_then_weights_written_then_train(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    source = _net()
    opt = _opt(source, overlap)
    _steps(source, opt, 2, [])
    model = _net()
    model.load_state_dict(source.state_dict())
    resumed = _opt(model, overlap)
    resumed.load_state_dict(opt.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)  # weights written after the optimizer's load: the next step must adopt them
    _steps(model, resumed, 2, seen, first=2)
    return model


def _two_optimizers_over_one_model(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    named = list(model.named_parameters())
    a = HybridDeviceOptimizer(named[:7], 1.0, lr=0.01, bucket_numel=80, overlap_step_with_backward=overlap)
    b = HybridDeviceOptimizer(named[7:], 1.0, lr=0.02, bucket_numel=80, overlap_step_with_backward=overlap)
    for step in range(3):
        model(_batch(step, 0, WIDTH, torch.float32), step).square().mean().backward()
        if overlap:
            seen.append(a.step_in_progress and b.step_in_progress)
        a.step()
        b.step()
        a.zero_grad()
        b.zero_grad()
    return model


def _a_module_called_twice_in_forward(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    opt = _opt(model, overlap)
    for step in range(3):
        x = model.layers[1](torch.tanh(model.layers[1](model.layers[0](_batch(step, 0, WIDTH, torch.float32)))))
        model.layers[5](torch.tanh(x)).square().mean().backward()
        if overlap:
            seen.append(opt.step_in_progress)
        opt.step()
        opt.zero_grad()
    return model


def _two_losses_backward_one_after_the_other(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    opt = _opt(model, overlap)
    for step in range(3):
        h = model.layers[0](_batch(step, 0, WIDTH, torch.float32))
        first = model.layers[1](h.detach()).square().mean()
        second = model.layers[2](h).square().mean()
        first.backward()
        second.backward()
        if overlap:
            seen.append(opt.step_in_progress)
        opt.step()
        opt.zero_grad()
    return model


def _sgd_nesterov_host_kernel(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    opt = _opt(model, overlap, cpu_optimizer_cls=torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True)
    _steps(model, opt, 3, seen)
    return model


def _a_compiled_model(overlap: bool, seen: list[bool]) -> torch.nn.Module:
    model = _net()
    opt = _opt(model, overlap)
    compiled = torch.compile(model, backend="aot_eager")  # the hooks fire from the compiled backward too
    _steps(compiled, opt, 2, seen)
    return model


CASES: dict[str, Callable[[bool, list[bool]], torch.nn.Module]] = {
    f.__name__.lstrip("_"): f
    for f in (
        _graph_safe_grads_kept_and_zeroed,
        _graph_safe_grads_in_one_param_buckets,
        _zero_grad_keeping_buffers,
        _fp16_params_with_fp32_masters,
        _frozen_params,
        _param_group_added_after_two_steps,
        _load_state_dict_then_weights_written_then_train,
        _two_optimizers_over_one_model,
        _a_module_called_twice_in_forward,
        _two_losses_backward_one_after_the_other,
        _sgd_nesterov_host_kernel,
        _a_compiled_model,
    )
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_overlapped_mode_is_bit_identical_to_the_default_mode_in_this_combination(case):
    default = CASES[case](False, [])
    seen: list[bool] = []
    overlapped = CASES[case](True, seen)
    for (name, p), q in zip(default.named_parameters(), overlapped.parameters()):
        assert torch.equal(p, q), f"{case}: {name} differs between the default and the overlapped mode"
    assert seen and all(seen), f"{case}: no host update was queued during backward"


def test_offload_fraction_zero_starts_no_worker_and_matches_the_default_mode():
    default, overlapped = _net(), _net()
    _steps(default, _opt(default, False, 0.0), 2, [])
    before = set(threading.enumerate())
    opt = _opt(overlapped, True, 0.0)
    _steps(overlapped, opt, 2, [])
    assert all(torch.equal(p, q) for p, q in zip(default.parameters(), overlapped.parameters()))
    assert not [t for t in threading.enumerate() if t not in before and t.name == "offload_fsdp-host-step"]


def test_backward_twice_with_retain_graph_raises_from_the_second_backward_naming_defer_grad_copies():
    # Before step() wrote the params, the first backward's updates had already overwritten params the
    # graph saved: autograd's version error (naming no fix) came instead, depending on a race.
    model = _net()
    opt = _opt(model, True)
    loss = model(_batch(0, 0, WIDTH, torch.float32), 0).square().mean()
    loss.backward(retain_graph=True)
    # Private: no public call waits for the worker without also ending the step (deterministic from here on).
    opt._schedule.overlapped.worker.wait_quietly()  # every update of the first backward has run
    with pytest.raises(RuntimeError, match="received a gradient in another backward .*defer_grad_copies"):
        loss.backward()


def test_autograd_grad_without_backward_starts_nothing_and_step_matches_the_default_mode():
    results = []
    for overlap in (False, True):
        model = _net()
        opt = _opt(model, overlap)
        loss = model(_batch(0, 0, WIDTH, torch.float32), 0).square().mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        assert not opt.step_in_progress  # no .grad was accumulated
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_graph_safe_grads_are_staged_once_per_backward_in_the_default_mode(monkeypatch):
    model = _net()
    opt = _opt(model, False, graph_safe_grads=True)
    copies: list[int] = []
    real = SyncCopyEngine.stage_grad
    monkeypatch.setattr(SyncCopyEngine, "stage_grad", lambda *a: (copies.append(1), real(*a))[1])
    model(_batch(0, 0, WIDTH, torch.float32), 0).square().mean().backward()
    opt.step()
    assert len(copies) == len(opt.layout().params), "a grad staged during backward was copied again by step()"


class _KeepsWeight(torch.autograd.Function):
    """``h @ w.T`` whose backward reads ``w`` kept on ctx (not save_for_backward: no version check),
    after waiting for the overlapped updates queued so far (a deterministic point, no race)."""

    @staticmethod
    def forward(ctx, h, w, opt):
        ctx.w, ctx.opt = w, opt
        return h @ w.t()

    @staticmethod
    def backward(ctx, grad):
        # Private: no public call waits for the worker without also raising its failure or ending the step.
        ctx.opt._schedule.overlapped.worker.wait_quietly() if ctx.opt.options.schedule is Schedule.OVERLAPPED else None
        return grad @ ctx.w, None, None


def test_backward_reading_a_weight_after_its_grad_is_final_sees_the_old_value():
    # The worker used to write each param as soon as its update ran, during backward: a detached
    # use of a weight whose backward runs after the weight's grad is final silently read the new value.
    results = []
    for overlap in (False, True):
        model = _net()
        opt = _opt(model, overlap)
        x = _batch(0, 0, WIDTH, torch.float32)
        h = torch.tanh(model.layers[0](x))
        side = _KeepsWeight.apply(h, model.layers[5].weight.detach(), opt)  # runs after layers.5 in backward
        y = h
        for layer in model.layers[1:]:
            y = torch.tanh(layer(y))
        (y.square().mean() + side.square().mean()).backward()
        opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results))


def _ddp_body(rank: int, world_size: int) -> str:
    model = _net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = _opt(model, True)
    ddp(_batch(0, rank, WIDTH, torch.float32), 0).square().mean().backward()
    with pytest.raises(ValueError, match="changed in place or replaced .*DistributedDataParallel.*FSDP2") as info:
        opt.step()
    return str(info.value)


def test_ddp_all_reducing_after_the_hooks_makes_step_raise_naming_ddp_and_fsdp2():
    # DDP's post-accumulate all-reduce writes the averaged grad after our hook staged the local one
    messages = run_ranks(_ddp_body, world_size=2)
    assert len(messages) == 2
