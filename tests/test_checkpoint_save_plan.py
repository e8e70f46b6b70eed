"""A save plans once per layout: later saves of it spend no planning communication; any layout change is planned
again and loads exactly; a param group's options are stored once per group, whatever the number of parameters."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import checkpoint
from tests.distributed import count_collectives, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _sent(fn) -> tuple[Counter, int]:
    """Calls into torch.distributed while ``fn`` runs, and the pickled bytes this rank hands its object collectives."""
    count = count_collectives(fn)
    return count.calls, count.sent


def _state(rank: int, world_size: int, n: int, *, rows: int = 4, dtype=torch.float32, swap: bool = False) -> dict:
    where = world_size - 1 - rank if swap else rank
    return {
        f"t{i}": checkpoint.shard(
            torch.full((rows, 8), float(i + 10 * rank), dtype=dtype), (rows * world_size, 8), offsets=(rows * where, 0)
        )
        for i in range(n)
    }


def _load_equals(path: Path, state: dict, **options) -> bool:
    target = {
        k: checkpoint.shard(torch.zeros_like(v.local), tuple(v.shape), offsets=v.spec.offsets) for k, v in state.items()
    }
    checkpoint.load_state_dict(target, path, **options)
    return all(torch.equal(target[k].local, state[k].local) for k in state)


def _repeat_saves_body(rank: int, world_size: int, root: str) -> dict:
    root_path = Path(root)
    out = {}
    for n in (8, 200):
        state = _state(rank, world_size, n)
        out[n] = [_sent(lambda i=i: checkpoint.save_state_dict(state, root_path / f"n{n}_{i}")) for i in range(3)]
        assert _load_equals(root_path / f"n{n}_2", state)
    return out


def test_a_repeated_save_of_one_layout_sends_no_planning_data_whatever_the_number_of_tensors(tmp_path):
    results = run_ranks(_repeat_saves_body, 2, args=(str(tmp_path),))
    for rank_result in results:
        (first8, *again8), (first200, *again200) = rank_result[8], rank_result[200]
        # the first save of a layout sends it (grows with the tensors) ...
        assert first200[1] > first8[1] * 5
        # ... later saves send the same few bytes for 8 tensors as for 200 (up to the digits of a file's size), and
        # the same calls
        assert max(sent for _, sent in again200) <= min(sent for _, sent in again8) + 16
        assert again8[0][1] < first8[1]
        assert {tuple(sorted(c.items())) for c, _ in again8 + again200} == {tuple(sorted(first8[0].items()))}
        assert sum(first8[0].values()) <= 4


def _layout_changes_body(rank: int, world_size: int, root: str) -> dict:
    root_path = Path(root)
    changes = {
        "unchanged": _state(rank, world_size, 6),
        "new key": {
            **_state(rank, world_size, 6),
            "extra": checkpoint.shard(torch.ones(2, 8), (2 * world_size, 8), offsets=(2 * rank, 0)),
        },
        "key removed": _state(rank, world_size, 5),
        "shape": _state(rank, world_size, 5, rows=3),
        "dtype": _state(rank, world_size, 5, rows=3, dtype=torch.bfloat16),
        "sharding": _state(rank, world_size, 5, rows=3, dtype=torch.bfloat16, swap=True),
        "value key": {**_state(rank, world_size, 5, rows=3, dtype=torch.bfloat16, swap=True), "step": 7},
    }
    out = {}
    for i, (change, state) in enumerate(changes.items()):
        sent = [
            _sent(lambda state=state, i=i, j=j: checkpoint.save_state_dict(state, root_path / f"c{i}_{j}"))[1]
            for j in range(2)
        ]
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        loaded = _load_equals(root_path / f"c{i}_0", tensors) and _load_equals(root_path / f"c{i}_1", tensors)
        keys = set(checkpoint.open_checkpoint(root_path / f"c{i}_0").metadata.state_dict_metadata)
        out[change] = (sent, loaded, keys == set(state))
    # a subgroup of other ranks: its own plan (world size 1 here), never the default group's
    sub = dist.new_group([rank for rank in range(world_size)][:1])
    if rank == 0:
        state = _state(0, 1, 3)
        checkpoint.save_state_dict(state, root_path / "sub", process_group=sub)
        out["subgroup"] = ([1, 0], _load_equals(root_path / "sub", state, no_dist=True), True)
    dist.barrier()
    return out


def test_each_kind_of_layout_change_is_planned_again_and_loads_exactly(tmp_path):
    results = run_ranks(_layout_changes_body, 2, args=(str(tmp_path),))
    for rank_result in results:
        for change, (_, loaded, keys_match) in rank_result.items():
            assert loaded and keys_match, change
    # each change sends this rank's layout again: more than the second save of that layout, which sends none
    for change, (sent, _, _) in results[1].items():
        assert sent[0] > sent[1], change


def test_a_layout_change_in_one_process_is_planned_again_and_loads_exactly(tmp_path):
    state = {"a": torch.arange(6.0), "b": {"c": torch.ones(2, 3)}}
    checkpoint.save_state_dict(state, tmp_path / "one")
    changed = {"a": torch.arange(8.0), "b": {"c": torch.ones(2, 3, dtype=torch.float64)}, "d": 3}
    checkpoint.save_state_dict(changed, tmp_path / "two")
    target = {"a": torch.zeros(8), "b": {"c": torch.zeros(2, 3, dtype=torch.float64)}, "d": 0}
    checkpoint.load_state_dict(target, tmp_path / "two")
    assert torch.equal(target["a"], changed["a"]) and torch.equal(target["b"]["c"], changed["b"]["c"])
    assert target["d"] == 3
    # the same keys nested differently (another planner_data path) are a new layout too
    checkpoint.save_state_dict({"a": torch.arange(8.0), "b.c": torch.ones(2, 3), "d": 3}, tmp_path / "three")
    flat = {"a": torch.zeros(8), "b.c": torch.zeros(2, 3), "d": 0}
    checkpoint.load_state_dict(flat, tmp_path / "three")
    assert torch.equal(flat["b.c"], torch.ones(2, 3)) and flat["d"] == 3


def _grouped_model(seed: int, lrs: tuple[float, float]):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(6)])
    groups = [
        {"params": [p for layer in model[:3] for p in layer.parameters()], "lr": lrs[0], "weight_decay": 0.0},
        {"params": [p for layer in model[3:] for p in layer.parameters()], "lr": lrs[1], "betas": (0.8, 0.95)},
    ]
    opt = torch.optim.AdamW(groups)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def test_group_options_are_stored_once_per_group_and_each_group_keeps_its_own(tmp_path):
    model, opt = _grouped_model(0, (0.1, 0.3))
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    opened = checkpoint.open_checkpoint(tmp_path / "c")
    where = opened.metadata.storage_data
    per_param = {}
    for index, info in where.items():
        parts = index.fqn.split(".")
        if index.fqn.startswith("optimizer.param_groups.") and len(parts) > 4:  # <fqn>.<option>; fqn "3.weight"
            per_param.setdefault((parts[-1], (info.relative_path, info.offset, info.length)), []).append(index.fqn)
    # every parameter's option key points at one stored copy per distinct value (here: per group or shared)
    lr_ranges = {rng for (option, rng) in per_param if option == "lr"}
    assert len(lr_ranges) == 2
    assert sum(len(keys) for (option, _), keys in per_param.items() if option == "lr") == 12

    model2, opt2 = _grouped_model(1, (0.9, 0.9))
    checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    assert [g["lr"] for g in opt2.param_groups] == [0.1, 0.3]
    assert [g["betas"] for g in opt2.param_groups] == [(0.9, 0.999), (0.8, 0.95)]
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.0, 0.01]

    # plain DCP reads the per-parameter keys (torch's flattened layout) that share those copies
    model3, opt3 = _grouped_model(2, (0.5, 0.5))
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model3, opt3, options=options)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "c", no_dist=True)
    set_state_dict(model3, opt3, model_state_dict=msd, optim_state_dict=osd, options=options)
    assert [g["lr"] for g in opt3.param_groups] == [0.1, 0.3]
    assert [g["betas"] for g in opt3.param_groups] == [(0.9, 0.999), (0.8, 0.95)]


def test_a_blocking_save_and_load_leave_cyclic_gc_as_they_found_it_even_when_they_fail(tmp_path):
    import gc

    state = {"a": torch.arange(4.0), "n": 1}
    assert gc.isenabled()
    checkpoint.save_state_dict(state, tmp_path / "c")
    checkpoint.load_state_dict({"a": torch.zeros(4), "n": 0}, tmp_path / "c")
    assert gc.isenabled()
    with pytest.raises(ValueError, match="weights_only"):
        checkpoint.save_state_dict({"bad": object()}, tmp_path / "d")
    with pytest.raises(ValueError, match="missing"):
        checkpoint.load_state_dict({"b": torch.zeros(4)}, tmp_path / "c")
    assert gc.isenabled()
    gc.disable()
    try:
        checkpoint.save_state_dict(state, tmp_path / "e")
        checkpoint.load_state_dict({"a": torch.zeros(4), "n": 0}, tmp_path / "e")
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()
