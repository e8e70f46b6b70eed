"""Once wrapped, the inner optimizer is the wrapper's: saving or loading through it is refused, naming the wrapper.

Saving it used to write its groups and no state at all, which a strict load accepted
(indistinguishable from a checkpoint saved before the first step): resuming from it
restarted Adam's moments from zero without a word.
"""

import pytest
import torch

import checkpoint
from offload_fsdp import HybridDeviceOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WRAPPED = r"this AdamW is wrapped by a HybridDeviceOptimizer.*call {} on the HybridDeviceOptimizer"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _wrapped_and_trained(seed: int = 0):
    model = _model(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = HybridDeviceOptimizer(inner, offload_fraction=1)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    return model, inner, opt


def test_saving_the_wrapped_optimizer_is_refused_naming_the_wrapper_and_writes_nothing(tmp_path):
    model, inner, _ = _wrapped_and_trained()
    with pytest.raises(ValueError, match=WRAPPED.format(r"state_dict\(\)")):
        checkpoint.save(tmp_path / "c", model=model, optimizer=inner)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=WRAPPED.format(r"state_dict\(\)")):
        inner.state_dict()


def test_loading_into_the_wrapped_optimizer_is_refused_and_the_wrapper_keeps_its_state(tmp_path):
    model, inner, opt = _wrapped_and_trained()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    before = opt.state_dict()
    with pytest.raises(ValueError, match=WRAPPED.format(r"load_state_dict\(\)")):
        inner.load_state_dict(before)
    model2, inner2, opt2 = _wrapped_and_trained(seed=1)
    weights = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match=WRAPPED.format(r"state_dict\(\)")):
        checkpoint.load(tmp_path / "c", model=model2, optimizer=inner2)
    assert all(torch.equal(p, w) for p, w in zip(model2.parameters(), weights))  # refused before any read
    checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)  # the wrapper itself loads
    after = opt2.state_dict()["state"]
    for index, state in before["state"].items():
        assert torch.equal(after[index]["exp_avg"], state["exp_avg"])


def test_a_wrapped_optimizer_with_state_is_taken_over_and_then_refused(tmp_path):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().sum().backward()
    inner.step()  # trained alone first: the wrapper takes its state over at construction
    opt = HybridDeviceOptimizer(inner, offload_fraction=1)
    assert len(opt.state_dict()["state"]) == 4
    with pytest.raises(ValueError, match=WRAPPED.format(r"state_dict\(\)")):
        inner.state_dict()


def test_an_optimizer_that_keeps_no_state_still_round_trips_strictly(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: torch's SGD keeps no state at all
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    model2 = _model(1)
    checkpoint.load(tmp_path / "c", model=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
