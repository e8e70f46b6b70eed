"""Our checkpoints and plain torch.distributed.checkpoint read each other, with torch's default options too."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import checkpoint
from checkpoint.safe_unpickle import SafeLoadPlanner

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _setup(seed: int, lr: float, named: bool):
    model = _model(seed)
    params = model.named_parameters() if named else model.parameters()
    return model, torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def _trained(named: bool):
    model, opt = _setup(0, 1e-2, named)
    for _ in range(2):
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same(model, opt, model2, opt2):
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), (name, key)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert opt2.param_groups[0]["weight_decay"] == opt.param_groups[0]["weight_decay"]


@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
@pytest.mark.parametrize("flatten", [False, True], ids=["torch_default", "flattened"])
def test_plain_get_state_dict_and_dcp_load_read_our_checkpoint(tmp_path, flatten, named):
    if named and flatten:
        pytest.skip("torch's flattened layout asks for param_names once per parameter (N^2); we write it per group")
    model, opt = _trained(named)
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt, extra={"step": 2})

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    # torch's optimizer state is lazy: the state dict of one that never stepped has nothing to
    # load into, so step once first (as a plain-DCP user resuming does)
    model3, opt3 = _setup(4, 0.9, named)
    model3(torch.randn(1, 6)).sum().backward()
    opt3.step()
    opt3.zero_grad()
    msd, osd = get_state_dict(model3, opt3, options=options)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "ours", no_dist=True)
    set_state_dict(model3, opt3, model_state_dict=msd, optim_state_dict=osd, options=options)
    _assert_same(model, opt, model3, opt3)


@pytest.mark.parametrize("flatten", [False, True], ids=["torch_default", "flattened"])
def test_our_load_reads_a_plain_get_state_dict_dcp_save(tmp_path, flatten):
    model, opt = _trained(named=False)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "plain", no_dist=True)
    model2, opt2 = _setup(3, 0.7, named=False)
    checkpoint.load(tmp_path / "plain", model=model2, optimizer=opt2, require_manifest=False)
    _assert_same(model, opt, model2, opt2)


def test_saved_group_options_grow_linearly_with_named_parameters(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(8)])
    opt = torch.optim.AdamW(model.named_parameters())
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    keys = checkpoint.open_checkpoint(tmp_path / "c").metadata.state_dict_metadata
    assert [k for k in keys if k.endswith(".param_names")] == ["optimizer.param_groups.0.param_names"]
    model2 = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(8)])
    opt2 = torch.optim.AdamW(model2.named_parameters())
    checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    assert opt2.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]


def _grouped(seed: int, reverse: bool):
    model = _model(seed)
    groups = [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": list(model[2].parameters()), "lr": 0.3}]
    return model, torch.optim.AdamW(groups[::-1] if reverse else groups)


def _lr_by_name(model, opt) -> dict[str, float]:
    group_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    return {name: group_of[id(p)] for name, p in model.named_parameters()}


def test_our_load_of_torch_default_layout_gives_each_parameter_its_own_groups_options_in_any_group_order(tmp_path):
    model, opt = _grouped(0, reverse=False)
    msd, osd = get_state_dict(model, opt)  # unflattened: options under param_groups.<number>
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "plain", no_dist=True)
    model2, opt2 = _grouped(1, reverse=True)
    for group in opt2.param_groups:
        group["lr"] = 0.9
    checkpoint.load(tmp_path / "plain", model=model2, optimizer=opt2, require_manifest=False)
    assert _lr_by_name(model2, opt2) == _lr_by_name(model, opt)


def test_strict_load_of_torch_default_layout_names_the_params_its_optimizer_did_not_hold(tmp_path):
    model = _model(0)
    head_only = torch.optim.AdamW(model[2].parameters())
    model(torch.randn(2, 6)).sum().backward()
    head_only.step()
    msd, osd = get_state_dict(model, head_only)  # param_groups.0.params lists the head only
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "plain", no_dist=True)
    model2 = _model(1)
    with pytest.raises(ValueError, match=r"missing: optimizer\.state\.0\.weight\."):
        checkpoint.load(
            tmp_path / "plain", model=model2, optimizer=torch.optim.AdamW(model2.parameters()), require_manifest=False
        )


def _stepped_groups(seed: int, lrs: tuple[float, float], decays: tuple[float, float]):
    model = _model(seed)
    groups = [
        {"params": list(model[0].parameters()), "lr": lrs[0], "weight_decay": decays[0]},
        {"params": list(model[2].parameters()), "lr": lrs[1], "weight_decay": decays[1]},
    ]
    opt = torch.optim.AdamW(groups)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _options_by_name(model, opt) -> dict[str, tuple[float, float]]:
    group_of = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    return {name: group_of[id(p)] for name, p in model.named_parameters()}


@pytest.mark.parametrize("flatten", [False, True], ids=["torch_default", "flattened"])
def test_options_differing_per_group_are_stored_once_per_group_and_read_by_plain_dcp_load_and_ours(tmp_path, flatten):
    model, opt = _stepped_groups(0, (0.1, 0.3), (0.0, 0.05))
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt)
    # torch's flattened layout keys each option per parameter: the manifest lists those keys once per
    # group (its parameters and the keys whose one stored value they read), not key by key
    opened = checkpoint.open_checkpoint(tmp_path / "ours")
    option_keys = [k for k in opened.metadata.state_dict_metadata if k.startswith("optimizer.param_groups.")]
    listed = [k for k in opened.manifest.keys if k.startswith("optimizer.param_groups.")]
    per_group = len(opt.state_dict()["param_groups"][0]) + 1  # options, params and param_names of one group
    assert len(listed) <= 2 * per_group < len(option_keys)

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    plain_model, plain_opt = _stepped_groups(1, (0.9, 0.9), (0.5, 0.5))
    msd, osd = get_state_dict(plain_model, plain_opt, options=options)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "ours", no_dist=True)
    set_state_dict(plain_model, plain_opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    assert _options_by_name(plain_model, plain_opt) == _options_by_name(model, opt)

    ours_model, ours_opt = _stepped_groups(2, (0.9, 0.9), (0.5, 0.5))
    checkpoint.load(tmp_path / "ours", model=ours_model, optimizer=ours_opt)
    assert _options_by_name(ours_model, ours_opt) == _options_by_name(model, opt)
    _assert_same(model, opt, ours_model, ours_opt)


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
def test_many_small_parameters_take_no_more_bytes_than_plain_get_state_dict_and_dcp_save(tmp_path, named):
    # Per-parameter overhead dominates with tiny tensors: ours stores 11 more keys per parameter (torch's
    # flattened layout of the group options) and a manifest, and must still be no larger than plain DCP.
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.randn(8)) for i in range(300)})
    opt = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=1e-3)
    model_sum = sum(p.sum() for p in model.parameters())
    model_sum.backward()
    opt.step()
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "plain", no_dist=True)
    ours, plain = _dir_bytes(tmp_path / "ours"), _dir_bytes(tmp_path / "plain")
    assert ours <= plain, f"ours {ours / 300:.0f} B a parameter vs plain DCP {plain / 300:.0f}"


class _CountedId(int):
    """A saved param id that counts the equality tests made against it."""

    compared = 0

    def __eq__(self, other):
        _CountedId.compared += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


def _ids_counted(opt, osd):
    """A user's load pre-hook (runs before the library's own): every saved param id counts its comparisons."""
    groups = [{**g, "params": [_CountedId(i) for i in g["params"]]} for g in osd["param_groups"]]
    return {**osd, "param_groups": groups}


def test_load_into_a_plain_optimizer_compares_each_saved_param_id_a_bounded_number_of_times(tmp_path):
    # torch's Optimizer.load_state_dict looks up each state tensor's param id in its group's id list:
    # O(N^2) comparisons for N params. The load must stay linear, with the user's hooks still run.
    count = 300
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.randn(3)) for i in range(count)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model2 = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.zeros(3)) for i in range(count)})
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    for m, o in ((model, opt), (model2, opt2)):
        sum(p.square().sum() for p in m.parameters()).backward()
        o.step()
    opt.step()  # another step: the saved state differs from opt2's
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt)
    opt2.register_load_state_dict_pre_hook(_ids_counted)
    _CountedId.compared = 0
    checkpoint.load(tmp_path / "ck", model=model2, optimizer=opt2)
    assert 0 < _CountedId.compared <= 10 * count
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), (name, key)


def test_load_keeps_torchs_casting_of_step_per_group(tmp_path):
    # torch casts a loaded `step` to float32 on the param's device only in a fused or capturable group:
    # which group holds each param is what the linear-time lookup answers.
    model = _model(0)
    layers = [list(model[0].parameters()), list(model[2].parameters())]
    opt = torch.optim.AdamW([{"params": layers[0], "fused": True}, {"params": layers[1]}], lr=1e-2)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt)
    model2 = _model(1)
    layers2 = [list(model2[0].parameters()), list(model2[2].parameters())]
    opt2 = torch.optim.AdamW([{"params": layers2[0], "fused": True}, {"params": layers2[1]}], lr=0.5)
    reference = torch.optim.AdamW([{"params": layers2[0], "fused": True}, {"params": layers2[1]}], lr=0.5)
    reference.load_state_dict(opt.state_dict())
    checkpoint.load(tmp_path / "ck", model=model2, optimizer=opt2)
    for p in model2.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            ours, torchs = opt2.state[p][key], reference.state[p][key]
            assert (ours.dtype, ours.device) == (torchs.dtype, torchs.device), key
            assert torch.equal(ours, torchs), key


def _unpickled_keys(monkeypatch) -> list[str]:
    """The keys whose stored values loads unpickle from now on (one entry per unpickling)."""
    unpickled: list[str] = []
    real_load_bytes = SafeLoadPlanner.load_bytes
    monkeypatch.setattr(
        SafeLoadPlanner,
        "load_bytes",
        lambda self, item, value: unpickled.append(item.dest_index.fqn) or real_load_bytes(self, item, value),
    )
    return unpickled


def test_torchs_flattened_layout_loads_each_groups_options_once_not_once_per_parameter(tmp_path, monkeypatch):
    model, opt = _stepped_groups(0, (0.1, 0.3), (0.0, 0.05))
    opt.param_groups[1]["betas"] = [0.8, 0.9]  # a mutable option: every key gets a list of its own
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt)
    unpickled = _unpickled_keys(monkeypatch)
    ours_model, ours_opt, osd, report = _strictly_loaded_torch_state_dict(tmp_path / "ours", flatten=True)
    assert not report
    assert _options_by_name(ours_model, ours_opt) == _options_by_name(model, opt)
    _assert_same(model, opt, ours_model, ours_opt)
    option_keys = [k for k in osd if k.startswith("param_groups.")]
    assert len(option_keys) == 4 * len(opt.param_groups[0]) - 4  # 4 parameters, each with its group's options
    assert len(unpickled) <= 2 * len(opt.param_groups[0])  # each group's stored values once, not once per key
    betas = [osd[k] for k in option_keys if k.endswith(".betas") and osd[k] == [0.8, 0.9]]
    assert len(betas) == 2 and betas[0] is not betas[1]


def test_a_resume_reads_no_group_list_it_does_not_need(tmp_path, monkeypatch):
    # Every parameter has saved state and per-parameter options: the lists naming every parameter
    # (param_groups.<i>.params, saved_without_state) are read only to account for a parameter without state.
    model, opt = _stepped_groups(0, (0.1, 0.3), (0.0, 0.05))
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt)
    unpickled = _unpickled_keys(monkeypatch)
    model2, opt2 = _stepped_groups(2, (0.9, 0.9), (0.5, 0.5))
    checkpoint.load(tmp_path / "ours", model=model2, optimizer=opt2)
    assert _options_by_name(model2, opt2) == _options_by_name(model, opt)
    _assert_same(model, opt, model2, opt2)
    assert unpickled and not [k for k in unpickled if k.endswith((".params", ".saved_without_state"))]


@pytest.mark.parametrize("flatten", [False, True], ids=["torch_default", "flattened"])
def test_a_strict_load_state_dict_of_either_torch_layout_reads_our_checkpoint(tmp_path, flatten):
    # ours stores the group options in both layouts: the one not asked for is not unexpected
    model, opt = _stepped_groups(0, (0.1, 0.3), (0.0, 0.05))
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt)
    model2, opt2, _, report = _strictly_loaded_torch_state_dict(tmp_path / "ours", flatten=flatten)
    assert not report
    assert _options_by_name(model2, opt2) == _options_by_name(model, opt)
    _assert_same(model, opt, model2, opt2)


def _strictly_loaded_torch_state_dict(path, *, flatten: bool):
    """Another model and optimizer, filled through torch's state dict in the layout asked for by a strict
    ``checkpoint.load_state_dict`` from ``path`` (then ``set_state_dict``); with that state dict and the report."""
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, opt = _stepped_groups(2, (0.9, 0.9), (0.5, 0.5))
    msd, osd = get_state_dict(model, opt, options=options)
    report = checkpoint.load_state_dict({"model": msd, "optimizer": osd}, path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    return model, opt, osd, report


def test_a_strict_load_state_dict_still_names_a_saved_parameter_it_lacks_in_the_layout_asked_for(tmp_path):
    model, opt = _stepped_groups(0, (0.1, 0.3), (0.0, 0.05))
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model2, opt2 = _stepped_groups(2, (0.9, 0.9), (0.5, 0.5))
    msd, osd = get_state_dict(model2, opt2, options=options)
    del msd["2.bias"]
    for key in [k for k in osd if k.startswith(("state.2.bias.", "param_groups.2.bias."))]:
        del osd[key]
    # any of its option keys: the message names the first ten unexpected keys, in the order the checkpoint lists them
    with pytest.raises(ValueError, match=r"unexpected: .*optimizer\.param_groups\.2\.bias\.[a-z]") as raised:
        checkpoint.load_state_dict({"model": msd, "optimizer": osd}, tmp_path / "ours")
    assert "optimizer.param_groups.0.lr" not in str(raised.value)


def _named_flattened(seed: int, count: int):
    torch.manual_seed(seed)
    model = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.randn(2)) for i in range(count)})
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    sum(p.square().sum() for p in model.parameters()).backward()
    opt.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return model, opt, options, *get_state_dict(model, opt, options=options)


def test_torchs_flattened_layout_of_named_parameters_loads_in_time_linear_in_the_parameters(tmp_path, monkeypatch):
    # that layout keys the group's param_names (every name) once per parameter; one object in torch's
    # state dict. Each key still gets a list of its own, without a Python step per name and key (O(N^2)).
    import copy

    count = 300
    model, opt, options, msd, osd = _named_flattened(0, count)
    checkpoint.save_state_dict({"model": msd, "optimizer": osd}, tmp_path / "flat")
    model2, opt2, _, msd2, osd2 = _named_flattened(1, count)
    deep_copies = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda *args: deep_copies.append(1) or real_deepcopy(*args))
    checkpoint.load_state_dict({"model": msd2, "optimizer": osd2}, tmp_path / "flat")
    monkeypatch.undo()
    assert not deep_copies  # a list of strings is copied by one C call per key (deepcopy: a Python step per name)
    names = [k for k in osd2 if k.endswith(".param_names")]
    assert len(names) == count and len({id(osd2[k]) for k in names}) == count
    assert all(osd2[k] == osd[k] and len(osd[k]) == count for k in names)
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2, options=options)
    _assert_same(model, opt, model2, opt2)


def _python_calls(save) -> int:
    """How many Python functions (and C functions called from Python) ``save()`` calls in this thread."""
    import sys

    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")  # "call" also counts each step of a generator expression

    sys.setprofile(count)
    try:
        save()
    finally:
        sys.setprofile(None)
    return calls


def _save_async(state_dict, path) -> None:
    from checkpoint.async_save import async_save_state_dict

    async_save_state_dict(state_dict, path).result()


@pytest.mark.parametrize(
    "save",
    [
        checkpoint.save_state_dict,
        _save_async,  # stages the tree (its lists rebuilt) before writing
        lambda state_dict, path: (checkpoint.write_rank(path, 0, 1, state_dict), checkpoint.commit(path, world_size=1)),
    ],
    ids=["collective", "async", "write_rank"],
)
def test_torchs_flattened_layout_of_named_parameters_saves_in_time_linear_in_the_parameters(tmp_path, save):
    # that layout keys the group's param_names (every name) once per parameter, one list object in torch's
    # state dict: walked, checked or rebuilt at each reference, the save is O(N^2) (32 s at 4,000 params).
    # Each count is a new layout (a first save), so both pay the same kinds of work.
    count = 100
    calls = []
    for n in (count, 2 * count):
        model, opt, options, msd, osd = _named_flattened(0, n)
        calls.append(_python_calls(lambda: save({"model": msd, "optimizer": osd}, tmp_path / f"flat{n}")))
    assert calls[1] < 2.3 * calls[0], calls  # linear: ~2x; per reference: ~2.8x at these sizes, growing with n

    path = tmp_path / f"flat{2 * count}"
    model2, opt2, _, msd2, osd2 = _named_flattened(1, 2 * count)
    checkpoint.load_state_dict({"model": msd2, "optimizer": osd2}, path)
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2, options=options)
    _assert_same(model, opt, model2, opt2)
    model3, opt3, _, msd3, osd3 = _named_flattened(2, 2 * count)
    dcp.load({"model": msd3, "optimizer": osd3}, checkpoint_id=path, no_dist=True)
    assert all(osd3[k] == osd[k] for k in osd if k.endswith(".param_names"))
    set_state_dict(model3, opt3, model_state_dict=msd3, optim_state_dict=osd3, options=options)
    _assert_same(model, opt, model3, opt3)


def test_resolving_a_state_dict_copies_a_list_of_plain_values_once_however_often_it_is_referenced():
    from checkpoint.convert import resolve_stateful

    names = [f"p{i}" for i in range(4)]
    tree = {"optimizer": {f"param_groups.p{i}.param_names": names for i in range(4)}, "own": list(names)}
    resolved, found = resolve_stateful(tree)
    copies = list(resolved["optimizer"].values())
    assert not found and all(c == names and c is not names for c in copies)
    assert all(c is copies[0] for c in copies)  # as in the tree: one list
    assert resolved["own"] == names and resolved["own"] is not copies[0]


def test_our_key_flattening_equals_dcps_and_walks_a_list_referenced_from_every_key_once():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

    from checkpoint.convert import flatten_state_dict

    class CountedList(list):
        walks = 0

        def __iter__(self):
            CountedList.walks += 1
            return super().__iter__()

    t = torch.arange(3.0)
    names = CountedList(f"p{i}" for i in range(5))
    tree = {
        "model": {"w": t, 0: t, "pairs": [t, t], "nested": [[t], [1]], "dicts": [{"x": 1, "y": t}]},
        "optimizer": {f"param_groups.p{i}.param_names": names for i in range(5)},
        "extra": {"step": 3, "empty": [], "plain": [1, [2]], "tuple": (t, 1), "none": None},
    }
    ours, dcps = flatten_state_dict(tree), dcp_flatten(tree)
    assert ours[1] == dcps[1]
    assert ours[0].keys() == dcps[0].keys() and all(ours[0][k] is dcps[0][k] for k in ours[0])
    CountedList.walks = 0
    flatten_state_dict(tree)
    assert CountedList.walks == 1
    for clash in ({"a.b": 1, "a": {"b": 2}}, {"a": {"0": 1, 0: 2}}):
        with pytest.raises(ValueError, match="duplicated flatten key a"):
            dcp_flatten(clash)
        with pytest.raises(ValueError, match="duplicated flatten key a"):
            flatten_state_dict(clash)
