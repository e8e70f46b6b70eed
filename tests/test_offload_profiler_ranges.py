"""step()'s profiler ranges: present under a profiler, not entered at all without one (they cost ~0.1 ms cold)."""

import torch
from torch.profiler import ProfilerActivity, profile

from offload_fsdp import HybridDeviceOptimizer, trace

RANGES = {"HybridDeviceOptimizer.d2h", "HybridDeviceOptimizer.host_step", "HybridDeviceOptimizer.h2d"}


def _optimizer():
    params = [torch.randn(n, requires_grad=True) for n in (7, 300)]
    for p in params:
        p.grad = torch.randn_like(p)
    return HybridDeviceOptimizer(params, 1.0, lr=0.1)


def test_step_under_a_profiler_records_its_aggregate_and_per_bucket_ranges():
    opt = _optimizer()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    names = {event.name for event in prof.events()}
    assert RANGES <= names
    assert any(name.startswith("HybridDeviceOptimizer.host_step[bucket ") for name in names)


def test_step_without_a_profiler_enters_no_record_function(monkeypatch):
    opt = _optimizer()

    def refuse(name):
        raise AssertionError(f"record_function({name!r}) entered with no profiler on")

    monkeypatch.setattr(trace, "record_function", refuse)  # the one module entering the ranges
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    opt.step()
    assert not any(torch.equal(a, p) for a, p in zip(before, opt.param_groups[0]["params"]))  # it did step
