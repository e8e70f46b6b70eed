"""clip_grad_norm_ in one process: equal to torch.nn.utils.clip_grad_norm_ on the same gradients."""

from __future__ import annotations

import math

import pytest
import torch

from optim import clip_grad_norm_, get_grad, graph_safe_grads, set_grad

SHAPES = [(5, 3), (7,), (0, 4), (1, 1)]  # an empty tensor included


def _params(seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(dtype)
    return params


def _reference(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    for r, p in zip(ref, params):
        r.grad = get_grad(p).detach().float().clone()
    return ref


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and bits (a NaN equals itself)."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _torch_copy(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The same params and grads (same dtypes), for torch's own clip."""
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params):
        r.grad = get_grad(p).detach().clone()
    return ref


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtypes", ["fp32", "bf16", "fp32+bf16"])
def test_norm_and_clipped_grads_are_torchs_bit_for_bit(norm_type, foreach, max_norm, dtypes):
    params = _params(0, torch.bfloat16 if dtypes == "bf16" else torch.float32)
    if dtypes == "fp32+bf16":  # torch groups by dtype, norms each group in its dtype, stacks them promoted
        params += _params(8, torch.bfloat16)
    ref = _torch_copy(params)
    norm = clip_grad_norm_(params, max_norm, norm_type, foreach=foreach)
    # torch cannot take the inf-norm of an empty tensor (it adds nothing to any norm): leave it out there.
    kept = [r for r in ref if r.numel() or not math.isinf(norm_type)]
    ref_norm = torch.nn.utils.clip_grad_norm_(kept, max_norm, norm_type, foreach=foreach)
    assert _same_bits(norm, ref_norm), f"{norm} != torch's {ref_norm}"
    for p, r in zip(params, ref):
        assert _same_bits(p.grad, r.grad)


def test_decoupled_fp32_grads_of_bf16_params_are_read_and_clipped_in_place():
    params = _params(1, torch.bfloat16)
    for p in params:
        set_grad(p, p.grad.float())  # now in decoupled_grad; p.grad is None
    storages = [p.decoupled_grad.data_ptr() for p in params]
    ref = _reference(params)
    norm = clip_grad_norm_(params, 0.1)
    assert _same_bits(norm, torch.nn.utils.clip_grad_norm_(ref, 0.1))
    assert [p.decoupled_grad.data_ptr() for p in params] == storages and all(p.grad is None for p in params)
    for p, r in zip(params, ref):
        assert _same_bits(p.decoupled_grad, r.grad)


def test_bf16_grads_give_torchs_bf16_norm():
    params = _params(2, torch.bfloat16)
    norm = clip_grad_norm_(params, 1e6)
    assert norm.dtype == torch.bfloat16  # as torch computes it: per-tensor norms in the grads' dtype
    assert _same_bits(norm, torch.nn.utils.get_total_norm([p.grad for p in _torch_copy(params)]))


def test_params_without_grads_are_skipped_and_no_grads_give_zero():
    params = _params(3)
    params[1].grad = None
    ref = _reference([p for p in params if p.grad is not None])
    assert _same_bits(clip_grad_norm_(params, 1.0), torch.nn.utils.clip_grad_norm_(ref, 1.0))
    assert clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_norm_raises_on_request_and_otherwise_propagates_like_torch(bad):
    params = _params(4)
    params[0].grad[0, 0] = bad
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    ref = _reference(params)
    norm = clip_grad_norm_(params, 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert _same_bits(norm, ref_norm)
    for p, r in zip(params, ref):
        assert _same_bits(p.grad, r.grad)


def test_unsupported_norm_type_is_rejected():
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(_params(5), 1.0, norm_type=0)


def test_graph_safe_grads_keep_their_storage_through_clipping_and_zeroing():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    handle = graph_safe_grads(model.parameters())
    pointers = [p.grad.data_ptr() for p in model.parameters()]
    for _ in range(2):
        model(torch.randn(5, 3)).square().sum().backward()
        clip_grad_norm_(model.parameters(), 0.01)
        assert [p.grad.data_ptr() for p in model.parameters()] == pointers
        handle.zero_()
    assert all(not p.grad.any() for p in model.parameters())


def test_graph_safe_grads_put_other_dtypes_in_decoupled_grad():
    p = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
    handle = graph_safe_grads([p], grad_dtype=torch.float32)
    (buffer,) = handle.buffers.values()
    assert p.grad is None and p.decoupled_grad.dtype == torch.float32
    assert p.decoupled_grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_graph_safe_grads_clear_a_stale_decoupled_grad_so_get_grad_reads_the_view_backward_fills():
    weight = torch.nn.Parameter(torch.randn(3, 2, generator=torch.Generator().manual_seed(7)))
    weight.decoupled_grad = torch.full((3, 2), 7.0)  # left over from an earlier, decoupled, setup
    handle = graph_safe_grads([weight])
    handle.zero_()
    inputs = torch.randn(4, 3, generator=torch.Generator().manual_seed(8))
    (inputs @ weight).square().sum().backward()
    reference = weight.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad((inputs @ reference).square().sum(), reference)
    (buffer,) = handle.buffers.values()
    assert get_grad(weight).untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    torch.testing.assert_close(get_grad(weight), expected)


def test_graph_safe_grads_carry_the_gradient_get_grad_reads_into_a_view_of_another_slot():
    p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
    old = torch.arange(6.0).view(2, 3) / 4  # exact in bf16
    set_grad(p, old)  # fp32 gradient of a bf16 param: decoupled_grad
    graph_safe_grads([p])  # views in the param's own dtype: the gradient moves to .grad
    assert getattr(p, "decoupled_grad", None) is None and get_grad(p) is p.grad
    assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad.float(), old)


def test_a_backend_without_a_foreach_norm_kernel_falls_back_to_per_tensor_norms(monkeypatch):
    params = _params(7)
    expected = clip_grad_norm_(params, 1e6)

    def missing(*args, **kwargs):
        raise NotImplementedError("_foreach_norm is not implemented for this backend")

    monkeypatch.setattr(torch, "_foreach_norm", missing)
    torch.testing.assert_close(clip_grad_norm_(params, 1e6), expected)
    with pytest.raises(NotImplementedError):
        clip_grad_norm_(params, 1e6, foreach=True)  # asked for explicitly: the backend's error stands


@pytest.mark.parametrize(("config", "expected"), [
    ("cpu:gloo,xpu:xccl", "xpu"), ("cpu:gloo,xpu:gloo", "cpu"), ("cpu:gloo", "cpu"),
])  # fmt: skip
def test_the_norm_is_reduced_on_the_accelerator_its_group_has_a_backend_for(monkeypatch, config, expected):
    from optim import clip

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("xpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(clip.dist, "get_backend_config", lambda group=None: config)
    assert clip._reduce_device(None).type == expected


@pytest.mark.accelerator
def test_gradients_split_between_host_and_device_give_the_single_device_norm():
    params = _params(6)
    ref = _reference(params)
    device = torch.accelerator.current_accelerator()
    for p in params[::2]:
        p.data, p.grad = p.data.to(device), p.grad.to(device)
    for norm_type in (2.0, math.inf):
        # torch cannot take the inf-norm of an empty tensor (it adds nothing to any norm): leave it out there
        ref_norm = torch.nn.utils.get_total_norm(
            [r.grad for r in ref if r.numel() or not math.isinf(norm_type)], norm_type
        )
        norm = clip_grad_norm_(params, 1e6, norm_type)
        torch.testing.assert_close(norm.cpu(), ref_norm, rtol=1e-6, atol=0)
    clip_grad_norm_(params, 0.5)
    torch.nn.utils.clip_grad_norm_(ref, 0.5)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=1e-6, atol=1e-7)
