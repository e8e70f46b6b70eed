"""Graph-safe gradients on the path users take: the optimizer's ``zero_grad`` keeps every buffer.

A captured CUDA graph replays fixed addresses, so with ``graph_safe_grads=True`` every
gradient (``.grad`` or a ``decoupled_grad`` view) must be the same tensor at the same
address on every step, ``zero_grad()`` with torch's default ``set_to_none=True`` included,
and the results must be those of the same run without it (``torch.equal``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.grad import get_grad, set_grad
from optim import PrecisionPolicy, build_optimizer

FP32_MAIN_GRADS = PrecisionPolicy(main_grads_dtype=torch.float32)


def _model(dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(device, dtype)


def _backward(model: torch.nn.Module, step: int, *, decoupled: bool) -> None:
    """One backward. ``decoupled``: fp32 main grads accumulated into ``get_grad`` as Megatron-FSDP's hooks do."""
    dtype = next(model.parameters()).dtype
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(dtype)
    loss = model(x).float().square().mean()
    if not decoupled:
        loss.backward()
        return
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        main = get_grad(p)
        if main is None:
            set_grad(p, g.float())
        else:
            main.add_(g.float())  # into the buffer that is there (a graph-safe view, or last step's)


class _Grads:
    """Every param's gradient tensor and its address, held (so neither can be reused by a new tensor)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.grads = [get_grad(p) for p in model.parameters()]
        assert all(g is not None for g in self.grads)
        self.ptrs = [g.data_ptr() for g in self.grads]

    def __eq__(self, other: object) -> bool:
        assert isinstance(other, _Grads)
        same = all(a is b for a, b in zip(self.grads, other.grads))
        return same and self.ptrs == other.ptrs and len(self.grads) == len(other.grads)


def _addresses(model: torch.nn.Module) -> _Grads:
    return _Grads(model)


def _train(model, opt, *, decoupled: bool, steps: int = 3) -> list[_Grads]:
    seen = []
    for step in range(steps):
        _backward(model, step, decoupled=decoupled)
        seen.append(_addresses(model))
        opt.step()
        opt.zero_grad()  # torch's default set_to_none=True
    return seen


def _hybrid(model, fraction, **kwargs):
    return HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), fraction, **kwargs)


def _torch(model, **kwargs):
    return build_optimizer(model.parameters(), "adamw", lr=1e-2, **kwargs)


CASES = {
    "hybrid 0": (lambda m, **kw: _hybrid(m, 0.0, **kw)),
    "hybrid 0.5": (lambda m, **kw: _hybrid(m, 0.5, **kw)),
    "hybrid 1": (lambda m, **kw: _hybrid(m, 1.0, **kw)),
    "torch backend": _torch,
    "torch backend, host offload": (lambda m, **kw: _torch(m, offload_fraction=0.5, **kw)),
}


@pytest.mark.filterwarnings("ignore:PrecisionPolicy exp_avg/exp_avg_sq dtypes apply:UserWarning")
@pytest.mark.parametrize("grads", ["fp32 .grad", "bf16 params, fp32 decoupled_grad"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_keeps_its_buffer_and_address_across_steps_and_results_equal_the_plain_run(case, grads):
    build = CASES[case]
    decoupled = grads != "fp32 .grad"
    dtype = torch.bfloat16 if decoupled else torch.float32
    kwargs = {"precision": FP32_MAIN_GRADS} if decoupled else {}
    safe_model, plain_model = _model(dtype), _model(dtype)
    safe = build(safe_model, graph_safe_grads=True, **kwargs)
    plain = build(plain_model, **kwargs)
    if decoupled:  # the views sit in the decoupled slot, before any backward
        assert all(p.grad is None and p.decoupled_grad.dtype == torch.float32 for p in safe_model.parameters())
    seen = _train(safe_model, safe, decoupled=decoupled)
    _train(plain_model, plain, decoupled=decoupled)
    assert seen[0] == seen[1] == seen[2], "a gradient moved: a captured graph would write stale memory"
    assert all(not get_grad(p).any() for p in safe_model.parameters()), "zero_grad zeroes in place"
    for a, b in zip(safe_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["hybrid 1", "torch backend"])
def test_zero_grad_points_a_slot_someone_replaced_back_at_its_buffer(case):
    model = _model(torch.float32)
    opt = CASES[case](model, graph_safe_grads=True)
    first = _addresses(model)
    weight = model[0].weight
    weight.grad = None  # e.g. torch's own Optimizer.zero_grad, or a stray assignment
    opt.zero_grad()
    assert _addresses(model) == first


def test_a_param_group_added_later_gets_graph_safe_gradients_too():
    model = _model(torch.float32)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt = HybridDeviceOptimizer(first, 1.0, lr=1e-2, graph_safe_grads=True)
    opt.add_param_group({"params": second})
    _backward(model, 0, decoupled=False)
    before = _addresses(model)
    opt.step()
    opt.zero_grad()
    _backward(model, 1, decoupled=False)
    assert _addresses(model) == before


def test_frozen_params_get_no_gradient_buffer_and_are_cleared_as_torch_does():
    model = _model(torch.float32)
    model[0].weight.requires_grad_(False)
    opt = _hybrid(model, 1.0, graph_safe_grads=True)
    assert model[0].weight.grad is None and model[0].bias.grad is not None
    opt.zero_grad()
    assert model[0].weight.grad is None


@pytest.mark.accelerator
@pytest.mark.parametrize("backend", ["hybrid", "torch"])
def test_a_captured_cuda_graph_of_forward_and_backward_writes_the_gradients_the_step_reads(backend):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device")
    device = "cuda"
    eager_model, graph_model = _model(torch.float32, device), _model(torch.float32, device)

    def build(model, **kw):
        if backend == "hybrid":
            return _hybrid(model, 1.0, **kw)
        return build_optimizer(model.parameters(), "adamw", lr=1e-2, cuda_graphs=True, **kw)

    eager, opt = build(eager_model), build(graph_model, graph_safe_grads=True)
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)).to(device) for s in range(4)]
    static_x = torch.zeros(4, 8, device=device)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph (autograd and kernel lazy init), as torch documents
        static_x.copy_(inputs[0])
        graph_model(static_x).square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad()
    graph = torch.cuda.CUDAGraph()
    # The host optimizer's backward hooks copy grads to the host: not inside a capture (step() copies them).
    no_copies = opt.defer_grad_copies() if backend == "hybrid" else contextlib.nullcontext()
    with no_copies, torch.cuda.graph(graph):
        graph_model(static_x).square().mean().backward()
    opt.zero_grad()
    addresses = _addresses(graph_model)
    for x in inputs:
        static_x.copy_(x)
        graph.replay()
        opt.step()
        opt.zero_grad()
        eager_model(x).square().mean().backward()
        eager.step()
        eager.zero_grad()
        assert _addresses(graph_model) == addresses
    torch.cuda.synchronize()
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
