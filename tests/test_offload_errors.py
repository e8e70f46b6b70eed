"""Every user error of HybridDeviceOptimizer is raised early, names the parameter and says the fix."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.shard_spec import SHARD_SPEC_ATTR, ShardSpec


def _named(n: int = 2) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer{i}.weight", torch.randn(4, 3, requires_grad=True)) for i in range(n)]


@pytest.mark.parametrize("model", [torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(3, 2))])
def test_a_module_instead_of_its_parameters_is_a_type_error_saying_what_to_pass(model):
    with pytest.raises(
        TypeError, match=r"got a module \(\w+\); pass its parameters, .*model\.parameters\(\).*or an optimizer"
    ):
        HybridDeviceOptimizer(model, 1.0, lr=0.1)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), float("inf")])
def test_offload_fraction_outside_zero_one_is_a_value_error(fraction):
    with pytest.raises(ValueError, match="offload_fraction must be in"):
        HybridDeviceOptimizer(_named(), fraction, lr=0.1)


@pytest.mark.parametrize(
    "fraction",
    ["0.5", None, 0.5j, True, False, torch.tensor([0.5, 0.5]), torch.tensor(True), [0.5]],
    ids=["str", "None", "complex", "True", "False", "tensor-2", "bool-tensor", "list"],
)
def test_offload_fraction_that_is_not_a_real_number_is_a_value_error_naming_it(fraction):
    with pytest.raises(ValueError, match="offload_fraction must be a real number in"):
        HybridDeviceOptimizer(_named(), fraction, lr=0.1)


@pytest.mark.parametrize("fraction", [torch.tensor(0.5), torch.tensor([0.5]), 1, np.float32(0.5), Fraction(1, 2)])
def test_offload_fraction_accepts_real_scalars_and_one_element_tensors(fraction):
    opt = HybridDeviceOptimizer(_named(), fraction, lr=0.1)
    assert opt.offload_fraction == float(fraction) and isinstance(opt.offload_fraction, float)


def test_sparse_gradient_is_rejected_naming_the_param():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = HybridDeviceOptimizer(emb.named_parameters(), 1.0, lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"'weight' has a sparse gradient"):
        opt.step()


def test_meta_param_is_rejected_naming_it():
    with pytest.raises(ValueError, match=r"'w' is on the meta device"):
        HybridDeviceOptimizer([("w", torch.empty(3, device="meta", requires_grad=True))], 1.0, lr=0.1)


def test_non_contiguous_param_is_rejected_naming_it():
    p = torch.randn(4, 3).t().requires_grad_()
    with pytest.raises(ValueError, match=r"'t' is not contiguous"):
        HybridDeviceOptimizer([("t", p)], 1.0, lr=0.1)


def test_flat_shard_that_does_not_fit_its_global_shape_is_rejected_naming_it():
    p = torch.zeros(6, requires_grad=True)
    setattr(p, SHARD_SPEC_ATTR, ShardSpec((2, 4), flat_start=4))  # [4, 10) runs past 8 elements
    with pytest.raises(ValueError, match=r"flat\.shard.*runs past"):
        HybridDeviceOptimizer([("flat.shard", p)], 1.0, lr=0.1)


def _megatron_shard(local_numel: int, flat_slice, global_shape=(2, 4)) -> torch.Tensor:
    p = torch.zeros(local_numel, requires_grad=True)
    p.megatron_fsdp_slice, p.orig_param = flat_slice, torch.empty(global_shape, device="meta")
    return p


@pytest.mark.parametrize(
    "local_numel, flat_slice, error, match",
    [
        (6, slice(4, 10), ValueError, r"flat\.shard.*runs past the global tensor of 8"),
        (
            3,
            slice(2, 6),
            ValueError,
            r"'flat\.shard': megatron_fsdp_slice .* covers 4 elements but the local shard has 3",
        ),
        (2, slice(0, 4, 2), TypeError, r"'flat\.shard'.*contiguous slice"),
    ],
    ids=["past-the-end", "wrong-length", "strided"],
)
def test_megatron_fsdp_slice_that_does_not_describe_the_local_shard_is_rejected_naming_it(
    local_numel, flat_slice, error, match
):
    with pytest.raises(error, match=match):
        HybridDeviceOptimizer([("flat.shard", _megatron_shard(local_numel, flat_slice))], 1.0, lr=0.1)
    HybridDeviceOptimizer([("flat.shard", _megatron_shard(3, slice(5, 8)))], 1.0, lr=0.1)  # a fitting one is fine


def test_grad_of_another_dtype_than_its_host_staging_is_a_type_error_with_the_fix():
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = HybridDeviceOptimizer([("w", p)], 1.0, lr=0.1)
    p.decoupled_grad = torch.ones(3)
    with pytest.raises(TypeError, match=r"'w'.*main_grads_dtype=torch.float32"):
        opt.step()


def test_grad_on_a_param_frozen_at_construction_is_rejected():
    named = _named()
    named[1][1].requires_grad_(False)
    opt = HybridDeviceOptimizer(named, 1.0, lr=0.1)
    named[1][1].grad = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"'layer1.weight' has a gradient but requires_grad was False"):
        opt.step()


@pytest.mark.parametrize("bad", [object, dict, HybridDeviceOptimizer])
def test_optimizer_class_that_is_not_a_torch_optimizer_is_a_type_error(bad):
    with pytest.raises(TypeError, match="cpu_optimizer_cls"):
        HybridDeviceOptimizer(_named(), 1.0, cpu_optimizer_cls=bad, lr=0.1)
    with pytest.raises(TypeError, match="gpu_optimizer_cls"):
        HybridDeviceOptimizer(_named(), 0.0, gpu_optimizer_cls=bad, lr=0.1)


class _DeviceOnlySGD(torch.optim.SGD):
    """Stands in for a GPU-only fused optimizer: refuses host tensors at step time."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type == "cpu":
                    raise RuntimeError("this kernel only supports CUDA tensors")
        return super().step(closure)


def test_optimizer_class_that_cannot_run_on_host_tensors_is_a_clear_type_error():
    named = _named()
    opt = HybridDeviceOptimizer(named, 1.0, cpu_optimizer_cls=_DeviceOnlySGD, lr=0.1)
    for _, p in named:
        p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match=r"_DeviceOnlySGD cannot run on host \(CPU\) tensors.*cpu_optimizer_cls="):
        opt.step()
    with pytest.raises(TypeError, match="cannot run on host"):
        HybridDeviceOptimizer(_named(), 1.0, cpu_optimizer_cls=_DeviceOnlySGD, lr=0.1).materialize_state()


def test_hyperparameters_next_to_a_wrapped_optimizer_are_rejected():
    inner = torch.optim.AdamW([p for _, p in _named()], lr=0.1)
    with pytest.raises(ValueError, match=r"\['lr'\].*set them on the wrapped optimizer"):
        HybridDeviceOptimizer(inner, 1.0, lr=0.2)
    with pytest.raises(TypeError, match="cannot wrap a HybridDeviceOptimizer"):
        HybridDeviceOptimizer(HybridDeviceOptimizer(inner, 1.0), 1.0)


def test_invalid_bucket_size_is_rejected():
    with pytest.raises(ValueError, match="bucket_numel"):
        HybridDeviceOptimizer(_named(), 1.0, lr=0.1, bucket_numel=0)


def test_turning_on_amsgrad_after_construction_is_refused():
    named = _named()
    opt = HybridDeviceOptimizer(named, 1.0, lr=0.1)
    opt.param_groups[0]["amsgrad"] = True
    for _, p in named:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="amsgrad was turned on after construction"):
        opt.step()


def _stepped(named, **kw):
    opt = HybridDeviceOptimizer(named, 1.0, lr=0.1, **kw)
    for _, p in named:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_loading_a_state_dict_with_other_groups_or_keys_or_shapes_names_the_problem():
    opt = _stepped(_named())
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="2 params but the loaded group has 1"):
        _stepped(_named()).load_state_dict({**sd, "param_groups": [{**sd["param_groups"][0], "params": [0]}]})
    with pytest.raises(ValueError, match="1 parameter groups, this optimizer has 2"):
        HybridDeviceOptimizer([{"params": [p]} for _, p in _named()], 1.0, lr=0.1).load_state_dict(sd)
    amsgrad = _stepped(_named(), amsgrad=True)
    with pytest.raises(
        ValueError, match=r"'layer0.weight' has keys \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\]"
    ):
        opt.load_state_dict(amsgrad.state_dict())
    bad = opt.state_dict()
    bad["state"][1] = {**bad["state"][1], "exp_avg": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 'layer1.weight' has local shape \(5,\)"):
        _stepped(_named()).load_state_dict(bad)
