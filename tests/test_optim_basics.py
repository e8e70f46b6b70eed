import pytest
import torch

from optim import PrecisionPolicy, get_grad, set_grad


def test_get_grad_prefers_decoupled_grad_over_grad():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    assert get_grad(p) is p.grad
    p.decoupled_grad = torch.full((3,), 2.0)
    assert get_grad(p) is p.decoupled_grad


def test_set_grad_routes_other_dtypes_to_decoupled_grad_and_clears_the_other_slot():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    fp32 = torch.ones(3)
    set_grad(p, fp32)
    assert p.grad is None and p.decoupled_grad is fp32
    same = torch.ones(3, dtype=torch.bfloat16)
    set_grad(p, same)
    assert p.grad is same and p.decoupled_grad is None


def test_precision_policy_follows_the_one_before_when_unset():
    policy = PrecisionPolicy(main_grads_dtype=torch.bfloat16)
    assert policy.resolved_main_grads_dtype == torch.bfloat16
    assert PrecisionPolicy().resolved_main_grads_dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"main_params_dtype": torch.bfloat16}, "main_params_dtype"),
        ({"exp_avg_dtype": torch.float16}, "exp_avg_dtype"),
        ({"main_grads_dtype": torch.int8}, "main_grads_dtype"),
    ],
)
def test_precision_policy_rejects_bad_combinations_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy(**kwargs)


def test_precision_policy_grad_comm_dtype_still_constructs_but_warns_that_nothing_reads_it():
    # The documented constructor keeps working (DESIGN.md's contract); the field has no effect.
    with pytest.warns(DeprecationWarning, match="grad_comm_dtype.*no effect.*reduce_dtype"):
        policy = PrecisionPolicy(grad_comm_dtype=torch.bfloat16)
    assert policy.grad_comm_dtype == torch.bfloat16 and policy.main_params_dtype == torch.float32


def test_precision_policy_is_frozen():
    with pytest.raises(AttributeError):
        PrecisionPolicy().exp_avg_dtype = torch.bfloat16
