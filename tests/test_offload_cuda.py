"""HybridDeviceOptimizer's device path: pinned buffers, side streams, and no missing sync.

Runs on whatever accelerator ``torch.accelerator`` reports (CUDA, XPU, a PrivateUse1
backend); skipped without one (see conftest): ``pytest -m accelerator``. The few
CUDA-only checks (exact-size ``cudaHostRegister``, CUDA profiler activity) are also
marked ``cuda``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer

pytestmark = pytest.mark.accelerator

DEVICE = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


class _Scale(torch.nn.Module):
    """y = x * w + b: one memory-bound elementwise kernel, so a forward that runs before
    the H2D copy of w has landed reads stale weights (a missing sync shows up as a mismatch)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))
        self.b = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return torch.tanh(x * self.w + self.b)


def _low_intensity_model(n=1 << 21, depth=6, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[_Scale(n) for _ in range(depth)]).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _train(model, opt, steps, n, micro_batches=1, clip=None, defer=False):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    losses = []
    for _ in range(steps):
        for i in range(micro_batches):
            x = torch.randn(n, device=DEVICE, generator=gen)
            loss = model(x).square().mean()
            with opt.defer_grad_copies() if defer and i < micro_batches - 1 else contextlib.nullcontext():
                loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.detach())
    torch.accelerator.synchronize()
    return torch.stack(losses)


def _master(opt, p):
    """The fp32 truth of ``p``: its ``master_param`` (host for offloaded shards), else ``p`` itself (fp32)."""
    state = opt.state[p]
    return (state["master_param"] if "master_param" in state else p).detach().float().cpu()


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_training_matches_plain_adamw_on_gpu_with_no_missing_sync(fraction, dtype):
    """Two checks a missing sync fails, neither loose enough to hide it.

    1. Right after every ``step()``, a copy of each param made on the main stream (as
       the next forward would read it, with no host sync in between) equals the cast
       of its fp32 master bit for bit: an H2D not waited for leaves old or half-copied
       values there.
    2. The fp32 masters track plain fp32 AdamW on the GPU within 1e-5 relative (CPU and
       GPU kernels differ by ulps); a step taken on stale weights moves them by ~lr.
       For bf16 params an ulp of master difference can flip a param's bf16 rounding,
       so a few isolated elements (< 0.1%) may drift further; a stale step moves far more.
    """
    n = 1 << 21
    model, ref = _low_intensity_model(n).to(dtype), _low_intensity_model(n).to(dtype)
    ref_masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    opt = HybridDeviceOptimizer(model.parameters(), fraction, lr=1e-2, bucket_numel=1 << 22)
    ref_opt = torch.optim.AdamW(ref_masters, lr=1e-2)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for step in range(8):
        x = torch.randn(n, device=DEVICE, generator=gen, dtype=dtype)
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        for m, p in zip(ref_masters, ref.parameters()):
            m.grad = p.grad.float()
        opt.step()
        seen = [p.detach().clone() for p in model.parameters()]  # main stream, like the next forward
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(ref_masters, ref.parameters()):
                p.copy_(m)
        torch.accelerator.synchronize()
        for i, (p, s) in enumerate(zip(model.parameters(), seen)):
            assert torch.equal(s.cpu(), _master(opt, p).to(dtype)), f"step {step}, param {i}: stale param read"
        opt.zero_grad()
        ref.zero_grad()
    for i, (p, m) in enumerate(zip(model.parameters(), ref_masters)):
        ours, theirs = _master(opt, p), m.detach().cpu()
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        else:
            close = torch.isclose(ours, theirs, rtol=1e-5, atol=1e-7)
            assert close.float().mean() > 0.999, f"param {i}: {(~close).sum()} of {close.numel()} masters drifted"


@pytest.mark.parametrize("defer", [False, True])
def test_gradient_accumulation_with_hooks_and_clipping_matches_plain_adamw_on_gpu(defer):
    n = 1 << 20
    model, ref = _low_intensity_model(n, depth=3), _low_intensity_model(n, depth=3)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ours = _train(model, opt, 4, n, micro_batches=3, clip=0.5, defer=defer)
    theirs = _train(ref, ref_opt, 4, n, micro_batches=3, clip=0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_cuda_host_registration_pins_exactly_the_bytes_used():
    model = _low_intensity_model(1 << 20, depth=2).to(torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=1e-2)
    pinned = opt.layout().arenas[0]
    assert pinned.role == "pinned" and pinned.pinned
    assert pinned.reserved_bytes - pinned.used_bytes < 64 * 2 * len(opt.layout().buckets)  # alignment only


def test_host_buffers_are_pinned_and_state_lives_on_the_host():
    n = 1 << 20
    model = _low_intensity_model(n, depth=2).to(torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=1e-2)
    assert opt.layout().arenas[0].pinned
    bucket = opt.layout().buckets[0]
    assert bucket.grad_dtype == bucket.param_dtype == torch.bfloat16 and bucket.param_staging  # 2 + 2 bytes cross PCIe
    assert bucket.pinned and bucket.master_dtype == torch.float32
    _train(model, opt, 1, n)  # grads now exist and are kept (zero_grad(set_to_none=False))
    before = torch.accelerator.memory_allocated()
    _train(model, opt, 2, n)
    assert all(t.device.type == "cpu" for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    assert (
        torch.accelerator.memory_allocated() - before < n
    )  # no device-side optimizer state or masters (4 B/param each)


@pytest.mark.cuda
def test_profiler_trace_shows_d2h_host_step_and_h2d_ranges():
    n = 1 << 20
    model = _low_intensity_model(n, depth=2)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=1e-2)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        _train(model, opt, 2, n)
    names = {e.name for e in prof.events()}
    assert {"HybridDeviceOptimizer.d2h", "HybridDeviceOptimizer.host_step", "HybridDeviceOptimizer.h2d"} <= names


def test_materialize_and_resume_on_gpu_are_bit_exact():
    n = 1 << 18
    a, b = _low_intensity_model(n, depth=2).to(torch.bfloat16), _low_intensity_model(n, depth=2).to(torch.bfloat16)
    opt_a = HybridDeviceOptimizer(a.parameters(), 0.5, lr=1e-2)
    opt_b = HybridDeviceOptimizer(b.parameters(), 0.5, lr=1e-2)
    _train(a, opt_a, 2, n)
    _train(b, opt_b, 2, n)
    saved = opt_b.state_dict()
    c = _low_intensity_model(n, depth=2, seed=5).to(torch.bfloat16)
    c.load_state_dict(b.state_dict())
    opt_c = HybridDeviceOptimizer(c.parameters(), 0.5, lr=1e-2)
    opt_c.materialize_state()
    opt_c.load_state_dict(saved)
    _train(a, opt_a, 2, n)
    _train(c, opt_c, 2, n)
    for x, y in zip(a.parameters(), c.parameters()):
        assert torch.equal(x, y)


def test_cpu_resident_params_always_update_on_the_host_and_the_fraction_counts_device_params():
    on_gpu = [torch.zeros(10, device=DEVICE, requires_grad=True) for _ in range(4)]
    on_cpu = torch.zeros(100, requires_grad=True)
    opt = HybridDeviceOptimizer(on_gpu[:2] + [on_cpu] + on_gpu[2:], 0.5, lr=0.1)
    assert opt.layout().offloaded == (True, True, True, False, False)
