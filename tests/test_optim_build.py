"""build_optimizer: each backend gets the arguments the precision policy calls for.

The Transformer Engine / apex checks run against small recording fakes here and
against the real libraries on a GPU machine (``-m cuda``), with the same
assertions: the fakes keep the attributes the real classes keep.
"""

from __future__ import annotations

import sys

import pytest
import torch

from optim import PrecisionPolicy, build_optimizer
from tests.fakes import fake_apex, fake_transformer_engine

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _params(dtype: torch.dtype, device: str = "cpu") -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(4, 3, dtype=dtype, device=device)) for _ in range(2)]


# --- torch backend -------------------------------------------------------------------------------------


def test_unknown_backend_or_name_raises_listing_the_valid_ones():
    with pytest.raises(ValueError, match="valid backends: torch, te, apex"):
        build_optimizer(_params(FP32), backend="deepspeed")
    with pytest.raises(ValueError, match="valid names: adamw, adam"):
        build_optimizer(_params(FP32), "sgd", backend="te")
    with pytest.raises(ValueError, match="valid names: adamw, adam, sgd"):
        build_optimizer(_params(FP32), "lion")


@pytest.mark.parametrize(
    "name, cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)]
)
def test_torch_backend_uses_the_fused_kernel_on_cpu(name, cls):
    opt = build_optimizer(_params(FP32), name, lr=0.1)
    assert type(opt) is cls
    assert opt.defaults["fused"] is True and opt.defaults["lr"] == 0.1


def test_torch_backend_falls_back_to_foreach_where_no_fused_kernel_exists():
    opt = build_optimizer(_params(FP32, device="meta"), "adamw")
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_torch_backend_keeps_an_explicit_fused_or_foreach_choice():
    opt = build_optimizer(_params(FP32), "adamw", foreach=False)
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]


def test_torch_backend_is_capturable_when_cuda_graphs_are_requested():
    assert build_optimizer(_params(FP32), "adam", cuda_graphs=True).defaults["capturable"] is True


def test_torch_backend_refuses_bf16_adam_state_instead_of_ignoring_it():
    policy = PrecisionPolicy(exp_avg_dtype=BF16)
    with pytest.raises(ValueError, match="backend='te' or offload_fraction"):
        build_optimizer(_params(FP32), precision=policy)


def test_torch_backend_refuses_cuda_graphs_over_python_main_param_hooks():
    with pytest.raises(ValueError, match="cuda_graphs"):
        build_optimizer(_params(BF16), cuda_graphs=True)


def test_param_groups_and_name_param_pairs_are_accepted():
    a, b = _params(FP32)
    opt = build_optimizer([{"params": [a], "lr": 0.5}, {"params": [b]}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    with pytest.raises(ValueError, match="no parameters"):
        build_optimizer([])


# --- Transformer Engine ---------------------------------------------------------------------------------


def _check_te_fp32_params_are_the_main_params(device: str) -> None:
    opt = build_optimizer(_params(FP32, device), "adamw", backend="te", lr=0.1)
    assert opt.master_weights is False and opt.use_decoupled_grad is False
    assert opt.adam_w_mode == 1 and opt.capturable is False
    assert opt.exp_avg_dtype == FP32 and opt.exp_avg_sq_dtype == FP32


def _check_te_bf16_params_get_master_weights_and_decoupled_grads(device: str) -> None:
    policy = PrecisionPolicy(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    opt = build_optimizer(_params(BF16, device), "adam", backend="te", precision=policy)
    assert opt.master_weights is True and opt.master_weight_dtype == FP32
    assert opt.use_decoupled_grad is True  # fp32 main grads of bf16 params live in decoupled_grad
    assert opt.exp_avg_dtype == BF16 and opt.exp_avg_sq_dtype == BF16
    assert opt.adam_w_mode == 0


def _check_te_bf16_grads_of_bf16_params_stay_in_grad(device: str) -> None:
    opt = build_optimizer(_params(BF16, device), backend="te", precision=PrecisionPolicy(main_grads_dtype=BF16))
    assert opt.master_weights is True and opt.use_decoupled_grad is False


def _check_te_cuda_graphs_make_it_capturable(device: str) -> None:
    assert build_optimizer(_params(FP32, device), backend="te", cuda_graphs=True).capturable is True


TE_CHECKS = [
    _check_te_fp32_params_are_the_main_params,
    _check_te_bf16_params_get_master_weights_and_decoupled_grads,
    _check_te_bf16_grads_of_bf16_params_stay_in_grad,
    _check_te_cuda_graphs_make_it_capturable,
]


@pytest.mark.parametrize("check", TE_CHECKS, ids=lambda c: c.__name__[len("_check_te_") :])
def test_te_fused_adam_gets_the_policy_arguments(monkeypatch, check):
    fake_transformer_engine.install(monkeypatch)
    check("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("check", TE_CHECKS, ids=lambda c: c.__name__[len("_check_te_") :])
def test_real_te_fused_adam_gets_the_policy_arguments(check):
    pytest.importorskip("transformer_engine.pytorch.optimizers")
    check("cuda")


def test_te_refuses_capturable_with_bf16_state(monkeypatch):
    fake_transformer_engine.install(monkeypatch)
    policy = PrecisionPolicy(exp_avg_dtype=BF16)
    with pytest.raises(ValueError, match="capturable"):
        build_optimizer(_params(FP32), backend="te", precision=policy, cuda_graphs=True)


def test_missing_te_raises_import_error_with_install_hint_and_no_substitute(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(ImportError, match="pip install .*transformer_engine"):
        build_optimizer(_params(FP32), backend="te")


def test_te_too_old_for_decoupled_grads_asks_for_an_upgrade(monkeypatch):
    fake_transformer_engine.install(monkeypatch, fake_transformer_engine.OldFusedAdam)
    with pytest.raises(ImportError, match="use_decoupled_grad.*upgrade"):
        build_optimizer(_params(BF16), backend="te")
    # fp32 params need none of the new arguments: the old class still builds.
    assert isinstance(build_optimizer(_params(FP32), backend="te"), fake_transformer_engine.OldFusedAdam)


# --- apex ----------------------------------------------------------------------------------------------


def _check_apex_fp32_params_need_no_master(device: str) -> None:
    opt = build_optimizer(_params(FP32, device), "adamw", backend="apex")
    assert opt.master_weights is False and opt.capturable is False and opt.adam_w_mode == 1


def _check_apex_fp16_params_get_master_weights_in_capturable_mode(device: str) -> None:
    policy = PrecisionPolicy(main_grads_dtype=FP16)
    opt = build_optimizer(_params(FP16, device), "adam", backend="apex", precision=policy)
    assert opt.master_weights is True and opt.capturable is True and opt.adam_w_mode == 0


APEX_CHECKS = [_check_apex_fp32_params_need_no_master, _check_apex_fp16_params_get_master_weights_in_capturable_mode]


@pytest.mark.parametrize("check", APEX_CHECKS, ids=lambda c: c.__name__[len("_check_apex_") :])
def test_apex_fused_adam_gets_the_policy_arguments(monkeypatch, check):
    fake_apex.install(monkeypatch)
    check("cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("check", APEX_CHECKS, ids=lambda c: c.__name__[len("_check_apex_") :])
def test_real_apex_fused_adam_gets_the_policy_arguments(check):
    pytest.importorskip("apex.optimizers")
    check("cuda")


@pytest.mark.parametrize(
    "dtype, policy, match",
    [
        (BF16, PrecisionPolicy(), "decoupled_grad"),
        (FP32, PrecisionPolicy(exp_avg_dtype=BF16), "fp32 only"),
        (BF16, PrecisionPolicy(main_grads_dtype=BF16), "bf16 params"),
    ],
)
def test_apex_refuses_what_it_cannot_honour(monkeypatch, dtype, policy, match):
    fake_apex.install(monkeypatch)
    with pytest.raises(ValueError, match=match):
        build_optimizer(_params(dtype), backend="apex", precision=policy)


def test_pypi_apex_is_recognised_as_not_nvidia_apex(monkeypatch):
    fake_apex.install_pypi_apex(monkeypatch)
    with pytest.raises(ImportError, match="not NVIDIA apex.*unrelated PyPI package"):
        build_optimizer(_params(FP32), backend="apex")


def test_missing_apex_raises_import_error_with_build_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)
    with pytest.raises(ImportError, match="github.com/NVIDIA/apex"):
        build_optimizer(_params(FP32), backend="apex")
