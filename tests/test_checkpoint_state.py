"""Every piece of state a user saves comes back: extra through rewrites, strict optimizer resume, Stateful values."""

import pytest
import torch

import checkpoint
from checkpoint.cli import main as fsdp_ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _trained(seed: int = 0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _extra(sched) -> dict:
    return {"step": 7, "sched": sched.state_dict(), "rng": torch.arange(5, dtype=torch.uint8), "note": "run-a"}


def _assert_same_extra(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    assert got["step"] == want["step"] and got["note"] == want["note"]
    assert got["sched"] == want["sched"]
    assert torch.equal(got["rng"], want["rng"])


@pytest.mark.parametrize("world_size", [1, 3])
def test_reshard_keeps_the_nested_extra_that_load_returns(tmp_path, world_size):
    model, opt, sched = _trained()
    extra = _extra(sched)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt, extra=extra)
    assert fsdp_ckpt(["reshard", str(tmp_path / "c"), str(tmp_path / "r"), "--world-size", str(world_size), "-q"]) == 0
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    got = checkpoint.load(tmp_path / "r", model=model2, optimizer=opt2)
    _assert_same_extra(got, extra)
    assert torch.equal(model2[0].weight, model[0].weight)


def test_export_to_a_torch_file_then_import_keeps_extra(tmp_path):
    model, opt, sched = _trained()
    extra = _extra(sched)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt, extra=extra)
    assert fsdp_ckpt(["export", str(tmp_path / "c"), str(tmp_path / "full.pt"), "--format", "torch", "-q"]) == 0
    assert fsdp_ckpt(["import", str(tmp_path / "full.pt"), str(tmp_path / "i"), "-q"]) == 0
    model2 = _model(1)
    got = checkpoint.load(tmp_path / "i", model=model2, optimizer=torch.optim.AdamW(model2.parameters()))
    _assert_same_extra(got, extra)


def test_a_checkpoint_resharded_by_the_old_writer_still_returns_its_extra(tmp_path):
    from checkpoint.manifest import METADATA_NAME
    from checkpoint.commit import write_metadata

    checkpoint.save(tmp_path / "c", model=_model(), extra={"step": 4})
    opened = checkpoint.open_checkpoint(tmp_path / "c")
    opened.metadata.planner_data = {k: (k,) for k in opened.metadata.state_dict_metadata}  # the old reshard's record
    (tmp_path / "c" / METADATA_NAME).unlink()
    write_metadata(tmp_path / "c", opened.metadata)
    assert checkpoint.load(tmp_path / "c", model=_model(), verify="none") == {"step": 4}


def test_strict_load_of_a_model_only_checkpoint_into_an_optimizer_names_the_first_param_without_state(tmp_path):
    model, opt, _ = _trained()
    checkpoint.save(tmp_path / "c", model=model)
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    with pytest.raises(ValueError, match=r"missing: optimizer\.state\.0\.weight\."):
        checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    result = checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2, strict=False)
    assert "optimizer.state.0.weight.exp_avg" in result.missing_keys
    assert "optimizer.state.2.bias.exp_avg_sq" in result.missing_keys
    assert not opt2.state  # nothing loaded: no made-up moments left behind
    assert torch.equal(model2[0].weight, model[0].weight)


def test_a_frozen_param_without_saved_state_is_not_an_error(tmp_path):
    model, opt, _ = _trained()
    checkpoint.save(tmp_path / "c", model=model)
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters())
    for p in model2.parameters():
        p.requires_grad_(False)
    checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
