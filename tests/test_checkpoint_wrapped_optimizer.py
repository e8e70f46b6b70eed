"""Once wrapped, the inner optimizer is the wrapper's: saving or loading through it is refused, naming the wrapper.

And a strict load refuses a checkpoint whose optimizer section holds no state for the
parameters the loading optimizer trains (what such a save used to write): resuming
from it would restart Adam's moments from zero without a word.
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


def test_strict_load_refuses_a_checkpoint_without_optimizer_state_for_trained_params(tmp_path):
    model = _model()
    # what saving the inner optimizer of a wrapper used to write: its groups, no state at all
    checkpoint.save(tmp_path / "c", model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    model2, _, opt2 = _wrapped_and_trained(seed=1)
    with pytest.raises(ValueError, match=r"holds no optimizer state for parameters this HybridDeviceOptimizer trains"):
        checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    model3 = _model(2)
    fresh = HybridDeviceOptimizer(torch.optim.AdamW(model3.parameters(), lr=1e-2), offload_fraction=1)
    with pytest.raises(ValueError, match=r"strict=False to load it anyway"):  # no state of its own yet, either
        checkpoint.load(tmp_path / "c", model=model3, optimizer=fresh)
    assert not fresh.state_dict()["state"]  # the refused load left no state behind
    result = checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2, strict=False)
    assert "optimizer.state.0.weight.exp_avg" in result.missing_keys


def test_an_optimizer_that_keeps_no_state_still_round_trips_strictly(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: torch's SGD keeps no state at all
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    model2 = _model(1)
    checkpoint.load(tmp_path / "c", model=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
