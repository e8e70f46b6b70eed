"""A strict load refuses a checkpoint whose optimizer state was lost, and still loads one saved before the first step.

Both hold no ``optimizer.state.<fqn>.*`` for a trained parameter; the save records
which parameters had none (``optimizer.saved_without_state``), so the load can tell
them apart. A checkpoint written without that record (before 2026-11, or by another
tool) loads as before, with a warning naming the parameters; plain DCP's
``get_state_dict`` gives every parameter state, so its checkpoints need no record.
"""

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

LOST = r"holds no state for 4 parameter\(s\) this optimizer trains \(0\.weight, 0\.bias, 2\.weight, 2\.bias\)"
FIX = r"pass strict=False to start their state fresh"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _trained(seed: int = 0, steps: int = 2):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _rewritten_without(src, dst, tmp_path, *names: str) -> None:
    """Rewrite ``src`` at ``dst`` (plain torch + the library) with the ``optimizer`` entries ``names`` removed."""
    dcp_to_torch_save(src, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    for name in names:
        del state["optimizer"][name]
    checkpoint.save_state_dict(state, dst)


def test_a_checkpoint_whose_optimizer_state_was_removed_is_refused_strictly_naming_the_params(tmp_path):
    model, opt = _trained()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    _rewritten_without(tmp_path / "c", tmp_path / "lost", tmp_path, "state")
    model2, opt2 = _trained(seed=1, steps=0)
    weights = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ValueError, match=f"{LOST}.*{FIX}"):
        checkpoint.load(tmp_path / "lost", model=model2, optimizer=opt2)
    assert all(torch.equal(p, w) for p, w in zip(model2.parameters(), weights))  # refused before any read
    assert not opt2.state  # the lazy state created for the load is gone again

    result = checkpoint.load(tmp_path / "lost", model=model2, optimizer=opt2, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert "optimizer.state.0.weight.exp_avg" in result.missing_keys
    assert not opt2.state  # starts fresh: the next step creates it


def test_a_checkpoint_saved_before_the_first_step_still_loads_strictly_without_a_warning(tmp_path, caplog):
    model, opt = _trained(steps=0)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    model2, opt2 = _trained(seed=1, steps=0)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        result = checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    assert not result.missing_keys and not opt2.state
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert "optimizer state" not in caplog.text


def test_a_param_without_a_gradient_yet_loads_strictly_beside_stepped_ones(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model[0](torch.randn(4, 6)).square().sum().backward()  # the last layer gets no gradient: no state
    opt.step()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    model2, opt2 = _trained(seed=1, steps=0)
    checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    saved = opt.state_dict()["state"]
    loaded = opt2.state_dict()["state"]
    assert sorted(loaded) == sorted(saved) == [0, 1]
    assert all(torch.equal(loaded[i]["exp_avg"], saved[i]["exp_avg"]) for i in saved)


def test_a_checkpoint_without_the_record_loads_as_before_with_a_warning_naming_the_params(tmp_path, caplog):
    model, opt = _trained()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    # as a checkpoint written before the record existed, that lost its state
    _rewritten_without(tmp_path / "c", tmp_path / "old", tmp_path, "state", "saved_without_state")
    model2, opt2 = _trained(seed=1, steps=0)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        checkpoint.load(tmp_path / "old", model=model2, optimizer=opt2)
    assert "no optimizer state for 4 parameter(s) this optimizer trains (0.weight, 0.bias, 2.weight" in caplog.text
    assert not opt2.state


def test_a_plain_dcp_checkpoint_saved_before_the_first_step_loads_strictly_without_a_warning(tmp_path, caplog):
    model, opt = _trained(steps=0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "plain")
    model2, opt2 = _trained(seed=1, steps=0)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        checkpoint.load(tmp_path / "plain", model=model2, optimizer=opt2, require_manifest=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    # get_state_dict creates every param's state (a step with zero gradients): nothing to account for
    assert "optimizer state" not in caplog.text


def test_a_renamed_checkpoint_saved_before_the_first_step_loads_strictly(tmp_path, cli):
    model, opt = _trained(steps=0)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    cli("reshard", tmp_path / "c", tmp_path / "r", "--world-size", "1", "--rename", "^", "net.", "-q")
    torch.manual_seed(1)
    renamed = torch.nn.Module()
    renamed.net = _model(seed=1)
    checkpoint.load(tmp_path / "r", model=renamed, optimizer=torch.optim.AdamW(renamed.parameters(), lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), renamed.parameters()))
