"""One master weight: one setting, one state key, and no copy that buys nothing on save or resume.

References: plain torch AdamW on fp32 copies of the bf16 params (the master's trajectory),
and the same optimizer run with the other spelling of the same setting. Stated tolerance:
none (``torch.equal``) unless a line says otherwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import checkpoint
from offload_fsdp import HybridDeviceOptimizer, transfer
from offload_fsdp.master import LEGACY_MASTER_KEYS, MASTER_KEY, canonical_state
from optim import PrecisionPolicy, build_optimizer

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

BF16 = torch.bfloat16
NO_MASTER = PrecisionPolicy(main_params_dtype=None)


def _model(seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device, BF16)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 6, generator=gen).to(model[0].weight.device, BF16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _assert_same_training_state(model, opt, other_model, other_opt) -> None:
    """Weights, and every fp32 state tensor (masters and moments: bf16 weights would hide their rounding)."""
    for a, b in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(a, b)
        assert opt.state[a].keys() == other_opt.state[b].keys()
        for name, value in opt.state[a].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other_opt.state[b][name])), name


def _hybrid(model: torch.nn.Module, fraction: float = 1.0, **kwargs) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), fraction, **kwargs)


# ---------------------------------------------------------------- one setting


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_param_update_in_fp32_false_warns_naming_its_replacement_and_runs_exactly_as_main_params_dtype_none(
    fraction,
):
    old_model, new_model = _model(), _model()
    with pytest.warns(DeprecationWarning, match=r"precision=PrecisionPolicy\(main_params_dtype=None\)"):
        old = _hybrid(old_model, fraction, param_update_in_fp32=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = _hybrid(new_model, fraction, precision=NO_MASTER)
    _steps(old_model, old, 0, 3)
    _steps(new_model, new, 0, 3)
    for a, b in zip(old_model.parameters(), new_model.parameters()):
        assert torch.equal(a, b)
        assert MASTER_KEY not in new.state[b] and not new.param_update_in_fp32


def test_param_update_in_fp32_true_contradicting_a_policy_without_masters_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"param_update_in_fp32=True contradicts .*main_params_dtype=None"):
        _hybrid(_model(), param_update_in_fp32=True, precision=NO_MASTER)


def test_torch_backend_without_masters_steps_bf16_params_in_their_own_dtype_like_torch():
    model, ref = _model(), _model()
    opt = build_optimizer(model.parameters(), "adamw", precision=NO_MASTER, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _steps(model, opt, 0, 3)
    _steps(ref, ref_opt, 0, 3)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r) and MASTER_KEY not in opt.state[p]


# ---------------------------------------------------------------- one key


def test_a_state_holding_the_master_under_both_keys_is_refused_naming_both():
    with pytest.raises(ValueError, match="master_param.*main_param"):
        canonical_state({MASTER_KEY: torch.zeros(1), LEGACY_MASTER_KEYS[0]: torch.zeros(1)})


def _legacy(state_dict: dict) -> dict:
    """``state_dict`` as an older version saved it: the master under ``main_param``."""
    state = {}
    for index, entry in state_dict["state"].items():
        state[index] = {(LEGACY_MASTER_KEYS[0] if k == MASTER_KEY else k): v for k, v in entry.items()}
    assert any(LEGACY_MASTER_KEYS[0] in entry for entry in state.values())
    return {**state_dict, "state": state}


@pytest.mark.parametrize("build", ["hybrid", "torch"])
def test_a_state_dict_with_the_legacy_main_param_key_loads_its_masters_and_resumes_bit_exact(build):
    def make(model):
        return _hybrid(model, 0.5) if build == "hybrid" else build_optimizer(model.parameters(), "adamw", lr=1e-2)

    straight = _model()
    straight_opt = make(straight)
    _steps(straight, straight_opt, 0, 5)
    model = _model()
    opt = make(model)
    _steps(model, opt, 0, 3)
    saved = _legacy(opt.state_dict())
    fresh_model = _model(7)
    fresh_model.load_state_dict(model.state_dict())
    fresh = make(fresh_model)
    fresh.load_state_dict(saved)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(fresh.state[q][MASTER_KEY], opt.state[p][MASTER_KEY])
        assert LEGACY_MASTER_KEYS[0] not in fresh.state[q]
    _steps(fresh_model, fresh, 3, 5)
    _assert_same_training_state(straight, straight_opt, fresh_model, fresh)


@pytest.mark.parametrize("target", ["hybrid", "torch"])
def test_a_checkpoint_with_legacy_main_param_keys_loads_strictly_and_resumes_bit_exact(tmp_path, target):
    # Written as the torch backend wrote it before the keys were one: optimizer.state.<fqn>.main_param.
    straight = _model()
    straight_opt = build_optimizer(straight.parameters(), "adamw", lr=1e-2)
    _steps(straight, straight_opt, 0, 5)
    model = _model()
    opt = build_optimizer(model.parameters(), "adamw", lr=1e-2)
    _steps(model, opt, 0, 3)
    for p in model.parameters():
        opt.state[p][LEGACY_MASTER_KEYS[0]] = opt.state[p].pop(MASTER_KEY)
    checkpoint.save(tmp_path / "old", model=model, optimizer=opt)
    stored = checkpoint.open_checkpoint(tmp_path / "old").metadata.state_dict_metadata
    assert any(k.endswith(".main_param") for k in stored) and not any(k.endswith(".master_param") for k in stored)

    fresh_model = _model(7)
    fresh = _hybrid(fresh_model) if target == "hybrid" else build_optimizer(fresh_model.parameters(), "adamw", lr=1e-2)
    checkpoint.load(tmp_path / "old", model=fresh_model, optimizer=fresh)  # strict
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(fresh.state[q][MASTER_KEY], opt.state[p][LEGACY_MASTER_KEYS[0]])
    if target == "torch":  # the same optimizer on both sides: the resume is the straight run
        _steps(fresh_model, fresh, 3, 5)
        _assert_same_training_state(straight, straight_opt, fresh_model, fresh)


def test_torch_backend_resumes_bit_exact_through_checkpoint_load_with_its_fp32_masters(tmp_path):
    straight = _model()
    straight_opt = build_optimizer(straight.parameters(), "adamw", lr=1e-2)
    _steps(straight, straight_opt, 0, 5)
    model = _model()
    opt = build_optimizer(model.parameters(), "adamw", lr=1e-2)
    _steps(model, opt, 0, 3)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    fresh_model = _model(7)
    fresh = build_optimizer(fresh_model.parameters(), "adamw", lr=1e-2)
    checkpoint.load(tmp_path / "c", model=fresh_model, optimizer=fresh)
    _assert_same_training_state(model, opt, fresh_model, fresh)  # fp32 moments stay fp32 through the load
    _steps(fresh_model, fresh, 3, 5)
    _assert_same_training_state(straight, straight_opt, fresh_model, fresh)


def test_torch_backend_master_adopts_a_param_written_between_steps_as_hybrid_does():
    models = [_model(), _model()]
    opts = [build_optimizer(models[0].parameters(), "adamw", lr=1e-2), _hybrid(models[1])]
    for model, opt in zip(models, opts):
        _steps(model, opt, 0, 2)
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # the user's write: the truth from here on
        _steps(model, opt, 2, 4)
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)
    written = opts[0].state[models[0][0].weight][MASTER_KEY]
    assert torch.equal(written, opts[1].state[models[1][0].weight][MASTER_KEY])


# ---------------------------------------------------------------- no copy that buys nothing


class _WeightReads(TorchDispatchMode):
    """Records every op that takes a tensor sharing storage with one of ``params``."""

    def __init__(self, params) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
            self.ops.append(func.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_save_reads_each_weight_only_through_views_never_a_copy_or_compare(tmp_path, fraction):
    model = _model()
    opt = _hybrid(model, fraction)
    _steps(model, opt, 0, 1)
    with _WeightReads(model.parameters()) as reads:
        checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    # the writer's own byte access (views); a copy or a compare would be a device-to-host pass on a GPU
    views = {"detach", "slice", "view", "alias", "as_strided", "t", "reshape", "expand", "_reshape_alias"}
    assert reads.ops and set(reads.ops) <= {f"{v}.default" for v in views} | {"slice.Tensor", "view.dtype"}


def _stored_masters(path) -> set[str]:
    keys = checkpoint.open_checkpoint(path).metadata.state_dict_metadata
    return {k for k in keys if k.endswith(f".{MASTER_KEY}")}


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD], ids=["fused host step", "delegated host step"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_master_is_saved_exactly_when_an_update_or_a_load_made_it_more_than_its_weight(tmp_path, fraction, cls):
    def build(model):
        hyper = {"lr": 1e-2, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 1e-2}
        return HybridDeviceOptimizer(cls(model.parameters(), **hyper), fraction)

    model = _model()
    opt = build(model)
    opt.materialize_state()
    checkpoint.save(tmp_path / "fresh", model=model, optimizer=opt)
    assert not _stored_masters(tmp_path / "fresh"), "a master equal to its weight is stored twice"
    assert all(MASTER_KEY in opt.state[p] for p in model.parameters()), "a save changed the optimizer's state"
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # a written weight is adopted: the master is still its weight widened
    checkpoint.save(tmp_path / "written", model=model, optimizer=opt)
    assert not _stored_masters(tmp_path / "written")
    _steps(model, opt, 0, 1)
    checkpoint.save(tmp_path / "stepped", model=model, optimizer=opt)
    assert _stored_masters(tmp_path / "stepped") == {
        f"optimizer.state.{n}.{MASTER_KEY}" for n, _ in model.named_parameters()
    }
    loaded_model = _model(7)
    loaded = build(loaded_model)
    checkpoint.load(tmp_path / "stepped", model=loaded_model, optimizer=loaded)
    checkpoint.save(tmp_path / "again", model=loaded_model, optimizer=loaded)
    assert _stored_masters(tmp_path / "again") == _stored_masters(tmp_path / "stepped")
    for p, q in zip(model.parameters(), loaded_model.parameters()):
        assert torch.equal(opt.state[p][MASTER_KEY], loaded.state[q][MASTER_KEY])


def _count_fetches(monkeypatch) -> list[int]:
    """Every copy engine made from now on counts its ``fetch`` calls (the device-to-host copy of a param)."""
    calls: list[int] = []
    real = transfer.copy_engine_for

    def made(device, **kw):
        engine = real(device, **kw)
        fetch = engine.fetch

        def counting(dst, src):
            calls.append(src.numel())
            fetch(dst, src)

        engine.fetch = counting
        return engine

    monkeypatch.setattr(transfer, "copy_engine_for", made)  # the one place engines are made
    return calls


def _resume_copies_each_offloaded_param_device_to_host_once(monkeypatch, path, stepped: bool, device: str) -> None:
    model = _model(0, device)
    opt = _hybrid(model)
    if stepped:
        _steps(model, opt, 0, 1)
    checkpoint.save(path, model=model, optimizer=opt)
    assert bool(_stored_masters(path)) == stepped
    fresh_model = _model(7, device)
    fetches = _count_fetches(monkeypatch)
    fresh = _hybrid(fresh_model)
    fetches.clear()  # construction's copies of the params: the count starts at the resume
    checkpoint.load(path, model=fresh_model, optimizer=fresh)
    _steps(fresh_model, fresh, 1, 2)  # the one refresh of a resume runs here
    assert sorted(fetches) == sorted(p.numel() for p in fresh_model.parameters())
    _steps(model, opt, 1, 2)
    _assert_same_training_state(model, opt, fresh_model, fresh)


@pytest.mark.parametrize("stepped", [False, True], ids=["masters rebuilt from weights", "masters saved"])
def test_a_resume_copies_each_offloaded_param_device_to_host_once(tmp_path, stepped, monkeypatch):
    _resume_copies_each_offloaded_param_device_to_host_once(monkeypatch, tmp_path / "c", stepped, "cpu")


@pytest.mark.accelerator
@pytest.mark.parametrize("stepped", [False, True], ids=["masters rebuilt from weights", "masters saved"])
def test_a_resume_copies_each_offloaded_param_device_to_host_once_on_an_accelerator(tmp_path, stepped, monkeypatch):
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None  # the marker skips this test without one
    _resume_copies_each_offloaded_param_device_to_host_once(monkeypatch, tmp_path / "c", stepped, accelerator.type)


@pytest.mark.parametrize("route", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_device_share_class_keeping_no_state_still_saves_its_fp32_masters_and_resumes_bit_exact(
    tmp_path, fraction, route
):
    """Plain SGD keeps no state of its own, but a bf16 param's fp32 master on the device share is state:
    it must be saved, or a resume restarts it from the bf16 weight and quietly drifts from an unbroken run."""

    def build(seed: int) -> tuple[torch.nn.Module, HybridDeviceOptimizer]:
        model = _model(seed)
        return model, HybridDeviceOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), fraction, bucket_numel=40)

    straight, straight_opt = build(0)
    _steps(straight, straight_opt, 0, 5)
    model, opt = build(0)
    _steps(model, opt, 0, 3)
    assert all(MASTER_KEY in opt.state_dict()["state"][i] for i in range(4)), "every stepped bf16 param has a master"
    fresh, fresh_opt = build(7)  # other weights: everything must come from the load
    if route == "checkpoint":
        checkpoint.save(tmp_path / "ck", model=model, optimizer=opt)
        checkpoint.load(tmp_path / "ck", model=fresh, optimizer=fresh_opt)
    else:
        fresh.load_state_dict(model.state_dict())
        fresh_opt.load_state_dict(opt.state_dict())
    _steps(fresh, fresh_opt, 3, 5)
    _assert_same_training_state(straight, straight_opt, fresh, fresh_opt)
