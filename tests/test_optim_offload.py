"""build_optimizer(offload_fraction=...) builds a HybridDeviceOptimizer that honours the precision policy.

The numerics check trains a small least-squares model for 100 steps twice, with
fp32 and with bf16 Adam moments on the host. Stated tolerance: the bf16-state
weights stay within 2% of the fp32 run's largest weight movement (measured:
about 0.6%), and the final loss within 1% (measured: about 0.03%).
"""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from optim import PrecisionPolicy, build_optimizer
from tests.fakes import fake_transformer_engine

BF16, FP32 = torch.bfloat16, torch.float32
BF16_STATE = PrecisionPolicy(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)


def _train(
    policy: PrecisionPolicy, steps: int = 100
) -> tuple[torch.Tensor, torch.Tensor, float, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(16, 32, generator=gen) * 0.1)
    bias = torch.nn.Parameter(torch.zeros(16))
    start = weight.detach().clone()
    opt = build_optimizer([weight, bias], "adamw", offload_fraction=1.0, precision=policy, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    inputs = torch.randn(256, 32, generator=gen)
    targets = inputs @ torch.randn(32, 16, generator=gen)
    for _ in range(steps):
        rows = torch.randint(0, 256, (32,), generator=gen)
        loss = (inputs[rows] @ weight.t() + bias - targets[rows]).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return start, weight.detach().clone(), loss.item(), opt


@pytest.mark.slow
def test_bf16_host_adam_state_tracks_fp32_state_within_tolerance_over_100_steps():
    start, fp32_weight, fp32_loss, _ = _train(PrecisionPolicy())
    _, bf16_weight, bf16_loss, opt = _train(BF16_STATE)
    weight = opt.param_groups[0]["params"][0]
    assert opt.state[weight]["exp_avg"].dtype == BF16 and opt.state[weight]["exp_avg_sq"].dtype == BF16
    movement = (fp32_weight - start).abs().max()
    assert (bf16_weight - fp32_weight).abs().max() <= 0.02 * movement
    assert bf16_loss == pytest.approx(fp32_loss, rel=0.01)
    assert not torch.equal(bf16_weight, fp32_weight)  # the two runs really differ in precision


def test_offload_fraction_builds_a_hybrid_optimizer_with_torch_fused_host_class_and_the_policy():
    params = [torch.nn.Parameter(torch.zeros(6, 2)), torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer(params, "adam", offload_fraction=1.0, precision=BF16_STATE, lr=0.1)
    assert isinstance(opt, HybridDeviceOptimizer)
    assert opt.cpu_optimizer_cls is torch.optim.Adam and opt.precision == BF16_STATE
    assert opt.offload_fraction == 1.0 and opt.param_groups[0]["lr"] == 0.1


@pytest.mark.filterwarnings("ignore:PrecisionPolicy exp_avg")  # HybridDeviceOptimizer's note on delegated classes
def test_offload_with_te_builds_its_device_class_as_te_fused_adam_configured_for_fp32_masters(monkeypatch):
    fake = fake_transformer_engine.install(monkeypatch)
    params = [torch.nn.Parameter(torch.zeros(4, 4, dtype=BF16)) for _ in range(2)]
    opt = build_optimizer(params, offload_fraction=0.5, backend="te", precision=BF16_STATE, lr=0.1)
    assert issubclass(opt.gpu_optimizer_cls, fake)
    inner = opt.gpu_optimizer_cls([torch.zeros(2)])
    # HybridDeviceOptimizer hands the device optimizer fp32 masters with .grad set.
    assert inner.master_weights is False and inner.use_decoupled_grad is False
    assert inner.exp_avg_dtype == BF16 and inner.exp_avg_sq_dtype == BF16 and inner.adam_w_mode == 1


@pytest.mark.filterwarnings("ignore:PrecisionPolicy exp_avg")
@pytest.mark.parametrize("name, weight_decay", [("adamw", 0.01), ("adam", 0.0)])
def test_offload_with_te_gives_both_shares_torchs_defaults_for_what_the_user_left_out(monkeypatch, name, weight_decay):
    fake_transformer_engine.install(monkeypatch)
    params = [torch.nn.Parameter(torch.zeros(4, 4, dtype=BF16)) for _ in range(2)]
    opt = build_optimizer(params, name, offload_fraction=0.5, backend="te", precision=BF16_STATE)
    # Private: the device class's own group values; the update shows them only through many steps.
    device_group = opt._placement.device_delegate.inner.param_groups[0]  # fraction 0.5 splits the CPU params
    host_defaults = opt.cpu_optimizer_cls([torch.zeros(1)]).defaults
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert device_group[key] == opt.param_groups[0][key] == host_defaults[key], key
    assert device_group["weight_decay"] == weight_decay


def test_offload_refuses_cuda_graphs():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="cuda_graphs"):
        build_optimizer(params, offload_fraction=1.0, cuda_graphs=True)


@pytest.mark.parametrize("fraction", [1.5, -0.1, float("nan")])
def test_offload_fraction_outside_0_1_is_refused_naming_it(fraction):
    with pytest.raises(ValueError, match="offload_fraction"):
        build_optimizer([torch.nn.Parameter(torch.zeros(3))], offload_fraction=fraction)
