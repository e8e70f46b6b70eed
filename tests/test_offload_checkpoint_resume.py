"""Resume of HybridDeviceOptimizer over bf16 params through an in-place checkpoint load is bit-exact.

The fp32 masters are saved as ``master_param``; an in-place load (``checkpoint.load``,
or plain DCP into ``get_state_dict``'s views + ``set_state_dict``) writes them into the
optimizer's own host masters, and nothing may then refresh them from the bf16 weights.
Stated tolerance: none (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import checkpoint
from offload_fsdp import HybridDeviceOptimizer
from optim import PrecisionPolicy

# one process, no process group: DCP says it assumes so, which is the point here
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    # fraction 0.5: the device share is a plain AdamW with fp32 moments, as the warning says
    pytest.mark.filterwarnings("ignore:PrecisionPolicy exp_avg/exp_avg_sq dtypes apply:UserWarning"),
]

BF16_STATE = PrecisionPolicy(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).bfloat16()


def _steps(model, opt, start, stop):
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(8, 16, generator=gen).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _build(seed, fraction, policy):
    model = _model(seed)
    return model, HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), fraction, precision=policy)


def _save_and_load_with_checkpoint(path, model, opt, fresh_model, fresh_opt):
    checkpoint.save(path, model=model, optimizer=opt)
    checkpoint.load(path, model=fresh_model, optimizer=fresh_opt)


def _save_and_load_with_plain_dcp(path, model, opt, fresh_model, fresh_opt):
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    msd, osd = get_state_dict(fresh_model, fresh_opt)  # views of the fresh optimizer's own state
    target = {"model": msd, "optim": osd}
    dcp.load(target, checkpoint_id=str(path))  # in place
    set_state_dict(fresh_model, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])


@pytest.mark.parametrize("policy", [PrecisionPolicy(), BF16_STATE], ids=["fp32 state", "bf16 state"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize(
    "route", [_save_and_load_with_checkpoint, _save_and_load_with_plain_dcp], ids=["checkpoint", "plain dcp"]
)
def test_bf16_params_resume_bit_exact_through_an_in_place_load(tmp_path, route, fraction, policy):
    straight, straight_opt = _build(0, fraction, policy)
    _steps(straight, straight_opt, 0, 5)

    model, opt = _build(0, fraction, policy)
    _steps(model, opt, 0, 3)
    fresh_model, fresh_opt = _build(7, fraction, policy)  # other weights: everything must come from the load
    route(tmp_path / "ck", model, opt, fresh_model, fresh_opt)
    masters = {k: v["master_param"].clone() for k, v in opt.state_dict()["state"].items() if "master_param" in v}
    loaded = {k: v["master_param"] for k, v in fresh_opt.state_dict()["state"].items() if "master_param" in v}
    assert masters and masters.keys() == loaded.keys()
    for k in masters:
        assert torch.equal(masters[k], loaded[k]), f"master of param {k} not the saved one"
    _steps(fresh_model, fresh_opt, 3, 5)
    for a, b in zip(straight.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
