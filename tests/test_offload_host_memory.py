"""Host arenas are sized exactly: reserved bytes are the bytes used plus alignment padding, nothing more."""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from optim import PrecisionPolicy

SIZES = (37, 1000, 3, 129, 0, 515)  # odd sizes, an empty param; their sum is no power of two


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_host_arenas_reserve_exactly_the_bytes_their_buffers_use_up_to_alignment(param_dtype, moment_dtype):
    params = [torch.zeros(n, dtype=param_dtype, requires_grad=True) for n in SIZES]
    policy = PrecisionPolicy(exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)
    opt = HybridDeviceOptimizer(params, 1.0, lr=0.01, precision=policy, bucket_numel=1100)
    buckets = opt.layout().buckets
    assert len(buckets) >= 2 and all(b.kernel is not None for b in buckets)

    separate_master = param_dtype != torch.float32
    per_element = (
        param_dtype.itemsize  # grad staging, the grad's own dtype
        + (param_dtype.itemsize if separate_master else 0)  # param staging H2D copies from
        + 4  # fp32 master
        + 2 * moment_dtype.itemsize  # exp_avg, exp_avg_sq
    )
    arenas = opt.layout().arenas
    assert sum(a.used_bytes for a in arenas) == sum(SIZES) * per_element
    for arena in arenas:
        used, reserved = arena.used_bytes, arena.reserved_bytes
        # the allocation itself is this size: no allocator rounding up (to a power of two or otherwise)
        assert arena.allocated_bytes == reserved
        # padding only before each buffer after the first, < 64 bytes each
        assert used <= reserved < used + 64 * max(len(arena.buffer_numels) - 1, 0) + 1, arena.buffer_numels
    # each bucket gets one buffer of its own size per role, and nothing else is allocated
    requested = sorted(n for a in arenas for n in a.buffer_numels)
    roles = 5 if separate_master else 4  # grad, [param staging], master, exp_avg, exp_avg_sq
    assert requested == sorted(b.numel for b in buckets for _ in range(roles))


def test_pinning_falls_back_from_cuda_registration_to_the_pinned_allocator_to_pageable(monkeypatch, caplog):
    from offload_fsdp import host_memory

    asked = []
    real_zeros = torch.zeros

    def zeros(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        return real_zeros(*args, **kwargs)  # stands in for a page-locked allocation

    # CUDA present but cudaHostRegister fails: torch's pinned allocator, not pageable memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory, "_register_pinned", lambda storage: False)
    monkeypatch.setattr(torch, "zeros", zeros)
    storage, pinned = host_memory._allocate(16, torch.float32, pin=True)
    assert pinned and asked == [False, True] and storage.shape == (16,)
    # no CUDA and no backend that can pin: pageable, and said so
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "zeros", real_zeros)
    with caplog.at_level("WARNING", logger="offload_fsdp.host_memory"):
        storage, pinned = host_memory._allocate(16, torch.float32, pin=True)
    assert not pinned and storage.shape == (16,) and "stay pageable" in caplog.text
