"""Key transforms (split / merge / rename) in process: planning from shapes, and the values they build."""

import re

import pytest
import torch

from checkpoint.tool.stream import Entry
from checkpoint.tool.transforms import Rename, Rules, Split, parse_part_list, plan, split_key, stream_targets

FC1 = "layers.*.mlp.linear_fc1.weight"
PARTS = ("layers.*.mlp.w.weight", "layers.*.mlp.v.weight")


class _DictSource:
    """A Source over a plain dict, reference for what transforms must produce."""

    def __init__(self, values: dict):
        self.values = values
        # sorted, as checkpoint readers list keys: a merge's parts need not come first-part-first
        self.entries = {
            k: Entry(k, "tensor", v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else Entry(k, "object")
            for k, v in sorted(values.items())
        }
        self.reads: list[str] = []

    def read(self, key):
        self.reads.append(key)
        return self.values[key]


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.linear_fc1.weight": torch.randn(6, 3, generator=g),
        "model.layers.1.mlp.linear_fc1.weight": torch.randn(6, 3, generator=g),
        "model.emb.weight": torch.randn(4, 3, generator=g),
        "optimizer.state.layers.0.mlp.linear_fc1.weight.exp_avg": torch.randn(6, 3, generator=g),
        "optimizer.state.layers.0.mlp.linear_fc1.weight.step": torch.tensor(5.0),
        "optimizer.param_groups.layers.0.mlp.linear_fc1.weight.lr": 0.01,
        "extra.step": 5,
    }


def _run(values: dict, rules: Rules) -> dict:
    source = _DictSource(values)
    return {t.name: v for t, v in stream_targets(source, plan(source.entries, rules))}


def test_split_key_finds_the_parameter_name_in_model_and_optimizer_keys():
    assert split_key("model.a.b") == ("model.", "a.b", "")
    assert split_key("optimizer.state.a.b.exp_avg") == ("optimizer.state.", "a.b", ".exp_avg")
    assert split_key("optimizer.param_groups.a.b.lr") == ("optimizer.param_groups.", "a.b", ".lr")
    assert split_key("extra.step") is None


def test_split_cuts_weights_and_their_optimizer_state_alike_and_copies_scalars():
    state = _state()
    out = _run(state, Rules(splits=(Split(FC1, 0, PARTS),)))
    w = state["model.layers.0.mlp.linear_fc1.weight"]
    torch.testing.assert_close(out["model.layers.0.mlp.w.weight"], w[:3], rtol=0, atol=0)
    torch.testing.assert_close(out["model.layers.0.mlp.v.weight"], w[3:], rtol=0, atol=0)
    m = state["optimizer.state.layers.0.mlp.linear_fc1.weight.exp_avg"]
    torch.testing.assert_close(out["optimizer.state.layers.0.mlp.v.weight.exp_avg"], m[3:], rtol=0, atol=0)
    assert out["optimizer.state.layers.0.mlp.w.weight.step"].item() == 5.0
    assert out["optimizer.param_groups.layers.0.mlp.v.weight.lr"] == 0.01
    assert "model.layers.0.mlp.linear_fc1.weight" not in out and out["extra.step"] == 5


def test_merge_with_the_split_arguments_restores_the_original_state():
    state = _state()
    rule = Split(FC1, 0, PARTS)
    split = _run(state, Rules(splits=(rule,)))
    merged = _run(split, Rules(merges=(rule,)))
    assert merged.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(merged[key], value, rtol=0, atol=0)
        else:
            assert merged[key] == value


def test_uneven_split_sizes_follow_name_colon_size_parts():
    names, sizes = parse_part_list("q:4,k:1,v:1")
    assert names == ("q", "k", "v") and sizes == (4, 1, 1)
    state = {"model.qkv": torch.arange(12.0).view(6, 2)}
    out = _run(state, Rules(splits=(Split("qkv", 0, names, sizes),)))
    assert [tuple(out[n].shape) for n in ("model.q", "model.k", "model.v")] == [(4, 2), (1, 2), (1, 2)]
    torch.testing.assert_close(out["model.k"], state["model.qkv"][4:5], rtol=0, atol=0)


def test_rename_runs_after_split_on_every_key_kind():
    state = _state()
    rules = Rules(renames=(Rename(r"^layers\.", "model.layers."),), splits=(Split(FC1, 0, PARTS),))
    out = _run(state, rules)
    assert "model.model.layers.1.mlp.w.weight" in out
    assert "optimizer.state.model.layers.0.mlp.w.weight.exp_avg" in out
    assert "optimizer.param_groups.model.layers.0.mlp.v.weight.lr" in out


def test_a_fused_tensor_is_read_once_for_all_its_parts():
    source = _DictSource(_state())
    list(stream_targets(source, plan(source.entries, Rules(splits=(Split(FC1, 0, PARTS),)))))
    assert len(source.reads) == len(set(source.reads)) == len(source.values)


@pytest.mark.parametrize(
    "rules, message",
    [
        (Rules(splits=(Split(FC1, 2, PARTS),)), "along dim 2"),
        (Rules(splits=(Split(FC1, 0, PARTS + ("layers.*.x", "layers.*.y")),)), "not divisible"),
        (Rules(splits=(Split(FC1, 0, PARTS, (2, 2)),)), "add up to 4"),
        (Rules(merges=(Split("fused.*", 0, ("emb.*", "missing.*")),)), r"\['model.missing.weight'\] not found"),
        (Rules(renames=(Rename(r"layers\.\d+", "same"),)), "one-to-one"),
    ],
)
def test_rules_that_cannot_apply_raise_value_errors_naming_the_key(rules, message):
    state = _state()
    with pytest.raises(ValueError, match=message):
        plan(_DictSource(state).entries, rules)


def test_bad_rule_syntax_is_a_value_error():
    with pytest.raises(ValueError, match="regex"):
        Rename("(", "x")
    with pytest.raises(ValueError, match="same number"):
        Split("a.*", 0, ("b", "c.*"))


def test_rules_file_gives_the_same_rules_as_flags(tmp_path):
    import json

    (tmp_path / "rules.json").write_text(
        json.dumps(
            {
                "rename": [["^emb\\.", "embed."]],
                "split": [{"fused": FC1, "dim": 0, "parts": list(PARTS)}],
            }
        )
    )
    from_file = Rules.from_file(tmp_path / "rules.json")
    assert from_file == Rules(renames=(Rename("^emb\\.", "embed."),), splits=(Split(FC1, 0, PARTS),))
    assert "model.embed.weight" in _run(_state(), from_file)
    (tmp_path / "bad.json").write_text('{"split": [{"fused": "x"}]}')
    with pytest.raises(ValueError, match="not valid"):
        Rules.from_file(tmp_path / "bad.json")


def test_splitting_an_optimizer_state_shaped_unlike_its_weight_is_refused():
    state = _state()
    state["optimizer.state.layers.0.mlp.linear_fc1.weight.exp_avg_sq_col"] = torch.ones(3)
    with pytest.raises(ValueError, match="differs from the weight"):
        plan(_DictSource(state).entries, Rules(splits=(Split(FC1, 0, PARTS),)))


def test_planning_compiles_every_rule_pattern_once_not_once_per_key(monkeypatch):
    state = {f"model.layers.{i}.mlp.w.weight": torch.zeros(2, 3) for i in range(50)}
    state |= {f"model.layers.{i}.mlp.v.weight": torch.zeros(2, 3) for i in range(50)}
    rules = Rules(renames=(Rename(r"^layers\.", "blocks."),), merges=(Split(FC1, 0, PARTS),))
    compiled = []
    real_compile = re.compile
    monkeypatch.setattr(re, "compile", lambda *a, **k: compiled.append(a[0]) or real_compile(*a, **k))
    targets = plan(_DictSource(state).entries, rules)
    assert compiled == []  # the rules compiled their patterns when they were made
    assert sorted(t.name for t in targets) == sorted(f"model.blocks.{i}.mlp.linear_fc1.weight" for i in range(50))
    assert {t.shape for t in targets} == {(4, 3)}


def test_entry_nbytes_is_numel_times_the_dtype_size_without_making_a_tensor(monkeypatch):
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
    ]
    expected = {d: 6 * torch.empty((), dtype=d).element_size() for d in dtypes}  # before torch.empty is blocked

    def no_tensors(*args, **kwargs):
        raise AssertionError("Entry.nbytes made a tensor")

    monkeypatch.setattr(torch, "empty", no_tensors)
    for dtype in dtypes:
        assert Entry("model.w", "tensor", dtype, (2, 3)).nbytes == expected[dtype], dtype
    assert Entry("extra.step", "object").nbytes == 0


def test_stack_builds_fused_experts_with_their_optimizer_state_and_unstack_is_its_inverse():
    from checkpoint.tool.transforms import Stack

    g = torch.Generator().manual_seed(0)
    values = {}
    for e in range(3):
        for part in ("gate", "up"):
            values[f"model.experts.{e}.{part}.weight"] = torch.randn(2, 4, generator=g)
            values[f"optimizer.state.experts.{e}.{part}.weight.exp_avg"] = torch.randn(2, 4, generator=g)
            values[f"optimizer.state.experts.{e}.{part}.weight.step"] = torch.tensor(7.0)
    source = _DictSource(values)
    rule = Stack("experts.gate_up", 0, ("experts.#.gate.weight", "experts.#.up.weight"))
    out = {t.name: v for t, v in stream_targets(source, plan(source.entries, Rules(stacks=(rule,))))}
    assert set(out) == {
        "model.experts.gate_up",
        "optimizer.state.experts.gate_up.exp_avg",
        "optimizer.state.experts.gate_up.step",
    }
    for e in range(3):
        want = torch.cat([values[f"model.experts.{e}.gate.weight"], values[f"model.experts.{e}.up.weight"]])
        assert torch.equal(out["model.experts.gate_up"][e], want)
    assert out["model.experts.gate_up"].shape == (3, 4, 4) and torch.equal(
        out["optimizer.state.experts.gate_up.step"], torch.tensor(7.0)
    )

    back = _DictSource(out)
    again = {t.name: v for t, v in stream_targets(back, plan(back.entries, Rules(unstacks=(rule,))))}
    assert again.keys() == values.keys()
    for key, value in values.items():
        assert torch.equal(again[key], value), key

    del values["model.experts.1.gate.weight"], values["model.experts.1.up.weight"]
    gap = _DictSource(values)
    with pytest.raises(ValueError, match=r"indices found are \[0, 2\]"):
        plan(gap.entries, Rules(stacks=(rule,)))


def test_reshape_gives_a_merged_tensor_its_shape():
    from checkpoint.tool.transforms import Reshape

    source = _DictSource({"model.w": torch.arange(24.0).reshape(6, 4)})
    [(target, value)] = stream_targets(source, plan(source.entries, Rules(reshapes=(Reshape("w", (2, 3, 4)),))))
    assert target.shape == (2, 3, 4) and torch.equal(value, torch.arange(24.0).reshape(2, 3, 4))
    with pytest.raises(ValueError, match="element counts differ"):
        plan(source.entries, Rules(reshapes=(Reshape("w", (5, 5)),)))
