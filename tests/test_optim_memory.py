"""bytes_per_param against hand-counted cases and against what HybridDeviceOptimizer really allocates on the
host, and the tables in docs/optim.md and README.md generated from it."""

from __future__ import annotations

import pathlib

import pytest
import torch

from optim import PrecisionPolicy, bytes_per_param
from optim.memory import STANDARD_CONFIGS, memory_table

BF16, FP32 = torch.bfloat16, torch.float32
REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "param_dtype, policy, offload, device, host",
    [
        # fp32 param (is the main param) 4 + fp32 grad 4 + exp_avg 4 + exp_avg_sq 4, nothing on the host
        (FP32, PrecisionPolicy(), 0.0, 16, 0),
        # offloaded: device keeps param 4 + grad 4; host has main 4 + moments 8 + pinned grad staging 4
        (FP32, PrecisionPolicy(), 1.0, 8, 16),
        # bf16 param 2 + fp32 decoupled grad 4 + fp32 master 4 + moments 8
        (BF16, PrecisionPolicy(), 0.0, 18, 0),
        # offloaded, fp32 decoupled grads: device 2 + 4; host master 4 + bf16 moments 4 + grad staging 4
        # + bf16 param staging 2
        (BF16, PrecisionPolicy(main_grads_dtype=FP32, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16), 1.0, 6, 14),
        # the same without main_grads_dtype: grads are staged in their own dtype (bf16, 2 B)
        (BF16, PrecisionPolicy(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16), 1.0, 6, 12),
        # bf16 grads: device 2 + 2, host master 4 + moments 8 + staging 2 + 2
        (BF16, PrecisionPolicy(main_grads_dtype=BF16), 1.0, 4, 16),
        # half offloaded fp32: device 8 + 8 * 0.5, host 16 * 0.5
        (FP32, PrecisionPolicy(), 0.5, 12, 8),
    ],
)
def test_bytes_per_param_matches_hand_counted_cases(param_dtype, policy, offload, device, host):
    footprint = bytes_per_param(policy, param_dtype, offload)
    assert (footprint.device, footprint.host) == (device, host)
    assert footprint.device == sum(footprint.device_parts.values())


def test_bf16_state_halves_the_host_bytes_of_adam_moments():
    fp32_state = bytes_per_param(PrecisionPolicy(), BF16, 1.0)
    bf16_state = bytes_per_param(PrecisionPolicy(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16), BF16, 1.0)
    assert fp32_state.host - bf16_state.host == 4
    assert bf16_state.host_parts["exp_avg"] == 2 and bf16_state.host_parts["exp_avg_sq"] == 2


def test_offload_outside_zero_to_one_is_rejected():
    with pytest.raises(ValueError, match="offload=1.5"):
        bytes_per_param(None, FP32, 1.5)


@pytest.mark.parametrize("doc", ["docs/optim.md", "README.md"])
def test_docs_table_is_the_generated_one(doc):
    assert memory_table() in (REPO / doc).read_text(), f"{doc} is stale: regenerate with `python -m optim.memory`"


@pytest.mark.parametrize("label, param_dtype, policy", [pytest.param(*row, id=row[0]) for row in STANDARD_CONFIGS])
def test_host_bytes_per_param_of_each_table_row_are_what_the_offloading_optimizer_allocates(label, param_dtype, policy):
    from offload_fsdp import HybridDeviceOptimizer

    params = [torch.nn.Parameter(torch.zeros(shape, dtype=param_dtype)) for shape in [(7, 5), (13,), (3, 4, 2)]]
    opt = HybridDeviceOptimizer(torch.optim.AdamW(params, lr=0.1), offload_fraction=1, precision=policy)
    arenas = opt.layout().arenas
    numel = sum(p.numel() for p in params)
    used = sum(a.used_bytes for a in arenas)
    by_role = {a.role: a.used_bytes / numel for a in arenas}
    assert used / numel == bytes_per_param(policy, param_dtype, 1.0).host, f"{label}: host arenas {by_role}"
    # reserved = used + at most one alignment gap (< 64 B) per buffer
    padding = sum(a.reserved_bytes for a in arenas) - used
    assert 0 <= padding < 64 * sum(len(a.buffer_numels) for a in arenas)


@pytest.mark.parametrize(
    "name, param_dtype, device, host",
    [
        # fp32: device param 4 + grad 4; host main 4 + momentum_buffer 4 + grad staging 4
        ("sgd", FP32, 8, 12),
        # bf16 + fp32 master: device 2 + fp32 decoupled grad 4; host main 4 + momentum 4 (the master's
        # dtype) + grad staging 2 (its own dtype) + param staging 2
        ("sgd", BF16, 6, 12),
        # without momentum SGD keeps no state: host main 4 + grad staging 4
        ("sgd_no_momentum", FP32, 8, 8),
    ],
)
def test_sgd_counts_one_momentum_buffer_in_the_main_param_dtype(name, param_dtype, device, host):
    footprint = bytes_per_param(PrecisionPolicy(), param_dtype, 1.0, name=name)
    assert (footprint.device, footprint.host) == (device, host)
    assert "exp_avg" not in footprint.host_parts


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("param_dtype", [FP32, BF16])
def test_host_bytes_per_param_of_offloaded_sgd_are_what_the_optimizer_allocates(momentum, param_dtype):
    from offload_fsdp import HybridDeviceOptimizer

    params = [torch.nn.Parameter(torch.zeros(shape, dtype=param_dtype)) for shape in [(7, 5), (13,)]]
    opt = HybridDeviceOptimizer(torch.optim.SGD(params, lr=0.1, momentum=momentum), offload_fraction=1)
    used = sum(a.used_bytes for a in opt.layout().arenas) / sum(p.numel() for p in params)
    name = "sgd" if momentum else "sgd_no_momentum"
    assert used == bytes_per_param(PrecisionPolicy(), param_dtype, 1.0, name=name).host


def test_an_unknown_optimizer_name_is_a_value_error_listing_the_names():
    with pytest.raises(ValueError, match="valid names: adamw, adam, sgd"):
        bytes_per_param(None, FP32, 1.0, name="lamb")


def test_state_sizes_are_read_from_the_host_kernels_layout_adagrad_included():
    adagrad = bytes_per_param(PrecisionPolicy(), torch.bfloat16, 1.0, name="adagrad")
    assert adagrad.host_parts["sum"] == 4  # in the fp32 master's dtype, as AdagradKernel.state_layout says
    assert "sum" not in bytes_per_param(PrecisionPolicy(), torch.bfloat16, 1.0, name="adamw").host_parts
