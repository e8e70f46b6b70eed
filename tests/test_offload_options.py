"""``OffloadOptions``: one documented dataclass for the optimizer's settings; the keyword form keeps working."""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HostStepChoice, HybridDeviceOptimizer, OffloadOptions, Schedule


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_the_options_form_trains_bit_for_bit_as_the_keyword_form():
    by_keywords, by_options = _model(), _model()
    opt_k = HybridDeviceOptimizer(
        by_keywords.parameters(), 0.5, bucket_numel=40, overlap_step_with_backward=True, lr=0.01
    )
    options = OffloadOptions(offload_fraction=0.5, bucket_numel=40, schedule=Schedule.OVERLAPPED)
    opt_o = HybridDeviceOptimizer(by_options.parameters(), options=options, lr=0.01)
    _train(by_keywords, opt_k)
    _train(by_options, opt_o)
    assert all(torch.equal(a, b) for a, b in zip(by_keywords.parameters(), by_options.parameters()))
    assert opt_o.options is options and opt_k.options.schedule is Schedule.OVERLAPPED


def test_options_and_option_keywords_together_are_refused_naming_the_keywords():
    with pytest.raises(ValueError, match=r"\['bucket_numel'\] were passed as keywords together with options="):
        HybridDeviceOptimizer(_model().parameters(), options=OffloadOptions(), bucket_numel=8)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(offload_fraction=float("nan")), "offload_fraction must be in"),
        (dict(offload_fraction=True), "not a bool"),
        (dict(bucket_numel=0), "bucket_numel must be positive"),
        (dict(pinned_transfer_slots=0), "pinned_transfer_slots must be"),
        (dict(schedule=Schedule.OVERLAPPED, overlap_cpu_optimizer_d2h_h2d=False), "needs overlap_cpu_optimizer"),
        (dict(host_step="sometimes"), "HostStepChoice"),
    ],
)
def test_each_setting_is_validated_when_the_options_are_built(settings, message):
    with pytest.raises(ValueError, match=message):
        OffloadOptions(**settings)


def test_the_host_step_choice_comes_from_the_options_else_from_the_environment(monkeypatch):
    monkeypatch.setenv("OFFLOAD_FSDP_HOST_STEP", "bogus")
    with pytest.raises(ValueError, match="OFFLOAD_FSDP_HOST_STEP='bogus' is not a host step"):
        HybridDeviceOptimizer(_model().parameters(), lr=0.01)  # the environment variable keeps working
    model = _model()
    opt = HybridDeviceOptimizer(model.parameters(), options=OffloadOptions(host_step=HostStepChoice.FUSED), lr=0.01)
    _train(model, opt)  # the option, not the environment, chose the step
