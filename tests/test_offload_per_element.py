"""Optimizer classes whose update is not elementwise never run on a piece of a parameter."""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.per_element import (
    PER_ELEMENT_OPTIMIZERS,
    is_per_element,
    register_per_element,
)
from offload_fsdp.shard_spec import ShardSpec, attach_shard_spec
from tests.distributed import run_ranks


def _row_shard() -> torch.Tensor:
    """Rows 0-2 of a (6, 4) weight, as flat-buffer FSDP hands a rank its shard."""
    local = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    return attach_shard_spec(local, ShardSpec(global_shape=(6, 4), offsets=(0, 0)))


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_adafactor_on_a_sharded_param_is_refused_naming_class_param_and_way_out(fraction):
    with pytest.raises(ValueError, match=r"Adafactor .*'blocks.0.weight' is sharded \(local shape \(3, 4\) of \(6, 4\)\)"
                                         r".*not sharded.*register_per_element"):  # fmt: skip
        HybridDeviceOptimizer([("blocks.0.weight", _row_shard())], fraction,
                              cpu_optimizer_cls=torch.optim.Adafactor, lr=0.01)  # fmt: skip


def test_wrapping_adafactor_over_a_sharded_param_is_refused_and_a_later_group_too():
    inner = torch.optim.Adafactor([_row_shard()], lr=0.01)
    with pytest.raises(ValueError, match="Adafactor"):
        HybridDeviceOptimizer(inner, 1.0)
    inner.step()  # a failed wrap leaves the optimizer usable on its own
    opt = HybridDeviceOptimizer([torch.randn(6, 4, requires_grad=True)], 1.0, cpu_optimizer_cls=torch.optim.Adafactor)
    with pytest.raises(ValueError, match=r"Adafactor .*param_groups\[1\]\['params'\]\[0\]. is sharded"):
        opt.add_param_group({"params": [_row_shard()]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_adafactor_on_whole_params_matches_torch_adafactor(fraction):
    gen = torch.Generator().manual_seed(1)
    ours = [torch.randn(6, 4, generator=gen).requires_grad_() for _ in range(2)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = HybridDeviceOptimizer(torch.optim.Adafactor(ours, lr=0.01), fraction)
    ref_opt = torch.optim.Adafactor(ref, lr=0.01)
    for _ in range(3):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_elementwise_classes_and_their_subclasses_run_on_shards_and_others_can_be_registered():
    class LoggingAdamW(torch.optim.AdamW):
        pass

    class MyElementwiseSGD(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    assert is_per_element(torch.optim.SGD) and is_per_element(LoggingAdamW)
    assert not is_per_element(torch.optim.Adafactor) and not is_per_element(MyElementwiseSGD)
    HybridDeviceOptimizer([_row_shard()], 1.0, cpu_optimizer_cls=LoggingAdamW)
    with pytest.raises(ValueError, match="MyElementwiseSGD"):
        HybridDeviceOptimizer([_row_shard()], 1.0, cpu_optimizer_cls=MyElementwiseSGD)
    name = register_per_element(MyElementwiseSGD)
    try:
        HybridDeviceOptimizer([_row_shard()], 1.0, cpu_optimizer_cls=MyElementwiseSGD)
    finally:
        PER_ELEMENT_OPTIMIZERS.discard(f"{name.__module__}.{name.__qualname__}")


def _fsdp_body(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 6), mesh=init_device_mesh("cpu", (world_size,)))
    try:
        HybridDeviceOptimizer(torch.optim.Adafactor(model.named_parameters(), lr=0.01), 1.0)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_adafactor_on_fsdp2_row_shards_is_refused_on_every_rank():
    for message in run_ranks(_fsdp_body, world_size=2):
        assert "Adafactor" in message and "'weight' is sharded (local shape (3, 4) of (6, 4))" in message, message


class _TrustRatioAdamW(torch.optim.AdamW):
    """LAMB-style: AdamW's update rescaled by a per-tensor norm ratio (not elementwise)."""

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        before = [p.clone() for p in params]
        super().step(closure)
        for p, b in zip(params, before):
            update = p - b
            p.copy_(b + update * (b.norm() / (update.norm() + 1e-12)))


def test_a_subclass_that_overrides_step_of_an_elementwise_class_is_refused_on_a_sharded_param():
    assert not is_per_element(_TrustRatioAdamW)
    with pytest.raises(ValueError, match=r"_TrustRatioAdamW .*is sharded.*register_per_element"):
        HybridDeviceOptimizer([_row_shard()], 1.0, cpu_optimizer_cls=_TrustRatioAdamW)


def test_a_subclass_keeping_its_base_step_stays_elementwise_after_torch_wraps_its_step():
    class QuietAdamW(torch.optim.AdamW):
        pass

    # torch's Optimizer.__init__ may store a profiling wrapper of the inherited step on the class itself.
    QuietAdamW([torch.zeros(2, requires_grad=True)])
    assert is_per_element(QuietAdamW)
    HybridDeviceOptimizer([_row_shard()], 1.0, cpu_optimizer_cls=QuietAdamW)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_lbfgs_is_refused_at_construction_naming_the_class_and_the_way_out(fraction):
    params = [torch.randn(3, 2, requires_grad=True)]
    with pytest.raises(ValueError, match=r"LBFGS needs a closure.*use LBFGS directly"):
        HybridDeviceOptimizer(torch.optim.LBFGS(params), fraction)
    with pytest.raises(ValueError, match=r"LBFGS needs a closure"):
        HybridDeviceOptimizer(params, fraction, cpu_optimizer_cls=torch.optim.LBFGS)
