"""TieredCheckpointer: a node-local tier replicated to peer nodes, verified restore, durable fallback.

A "node" here is a group of ranks with its own local directory (``nodes=[...]``). A run trains
steps 1..5 saving locally every step and durably every 4, then the ranks of one node kill -9
themselves (after every rank's saves are committed and replicated: a barrier, no sleeps). The
restarted job restores and trains on to step 6; each rank compares, bit for bit, with a model
trained 1..6 in the same process without interruption.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import checkpoint
import checkpoint.tiered
from offload_fsdp import HybridDeviceOptimizer
from tests.distributed import RankFailed, run_ranks
from tests.test_checkpoint_dist import Net  # uneven shards on 2 and 4 ranks, and empty ones

pytestmark = pytest.mark.slow  # rank launches

CRASH_STEP = 5
END_STEP = 6


def _build(seed: int, world_size: int, fraction: float | None):
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for module in (*model.blocks, model.head, model):
        fully_shard(module, mesh=mesh)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, adamw if fraction is None else HybridDeviceOptimizer(adamw, fraction)


def _step(model, opt, step: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    full = {}
    for name, p in model.named_parameters():
        full[name] = p.full_tensor().detach().clone()
    for index, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                full[f"{index}.{key}"] = whole.detach().clone()
    return full


def _tiers(rank: int, root: str, nodes: list[int], **options) -> checkpoint.TieredCheckpointer:
    local = os.path.join(root, f"node{nodes[rank]}")
    return checkpoint.TieredCheckpointer(  # run: the scenarios restore copies of the crashed run's directories
        local, os.path.join(root, "durable"), local_every=1, durable_every=4, nodes=nodes, run="crashed", **options
    )


def _crash_run(rank, world_size, root, nodes, fraction, killed_node) -> None:
    model, opt = _build(0, world_size, fraction)
    tiers = _tiers(rank, root, nodes)
    assert tiers.restore(model=model, optimizer=opt) is None  # nothing saved yet: a fresh start
    for step in range(1, CRASH_STEP + 1):
        _step(model, opt, step)
        tiers.save(step, model=model, optimizer=opt, extra={"step": step})
    tiers.wait()
    dist.barrier()  # every rank's local save, replica and durable save is committed
    if nodes[rank] == killed_node:
        os.kill(os.getpid(), signal.SIGKILL)


def _resume(rank, world_size, scenarios: list[dict]) -> list[dict]:
    """Each scenario restored in turn (one launch for all: each costs seconds), against one reference per fraction."""
    references: dict = {}
    out = []
    for scenario in scenarios:
        fraction = scenario["fraction"]
        if fraction not in references:
            reference, reference_opt = _build(0, world_size, fraction)
            for step in range(1, END_STEP + 1):
                _step(reference, reference_opt, step)
            references[fraction] = _full_state(reference, reference_opt)
        out.append(_resume_one(rank, world_size, scenario, references[fraction]))
    return out


def _resume_one(rank, world_size, scenario: dict, want: dict[str, torch.Tensor]) -> dict:
    if rank == scenario.get("silent_holder"):
        # A peer that never answers: this rank skips its sends (nothing public can make a live peer mute).
        real = checkpoint.tiered.exchange

        def mute_once(outgoing, incoming, **kw):
            checkpoint.tiered.exchange = real  # the saves after the restore replicate again
            real([], incoming, **kw)

        checkpoint.tiered.exchange = mute_once
    model, opt = _build(1, world_size, scenario["fraction"])  # other weights: everything must come from the restore
    tiers = _tiers(rank, scenario["root"], scenario["nodes"], **scenario.get("options", {}))
    restored = tiers.restore(model=model, optimizer=opt)
    assert restored is not None
    assert restored.extra["step"] == restored.step
    for step in range(restored.step + 1, END_STEP + 1):
        _step(model, opt, step)
        tiers.save(step, model=model, optimizer=opt, extra={"step": step})
    tiers.wait()
    ours = _full_state(model, opt)
    assert ours.keys() == want.keys()
    return {
        "step": restored.step,
        "source": restored.source,
        "skipped": restored.skipped,
        "differ": [k for k in want if not torch.equal(ours[k], want[k])],
    }


def _crashed(tmp: Path, world_size: int, nodes: list[int], fraction: float | None, killed_node: int) -> Path:
    root = tmp / "run"
    with pytest.raises(RankFailed, match="exited"):
        run_ranks(_crash_run, world_size, args=(str(root), nodes, fraction, killed_node))
    return root


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    """2 ranks on 2 nodes, HybridDeviceOptimizer(offload_fraction=1), crashed after step 5 (node 1 killed)."""
    return _crashed(tmp_path_factory.mktemp("two"), 2, [0, 1], 1.0, killed_node=1)


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory) -> Path:
    """4 ranks on 4 nodes, plain AdamW (no offload), crashed after step 5 (node 3 killed)."""
    return _crashed(tmp_path_factory.mktemp("four"), 4, [0, 1, 2, 3], None, killed_node=3)


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def two_rank_restores(two_nodes, four_nodes, tmp_path_factory) -> dict[str, list[dict]]:
    """The 2-rank scenarios, each on its own copy of a crashed run, restored in one launch: name -> per-rank results."""
    base = tmp_path_factory.mktemp("two_restores")
    roots = {name: base / name for name in ("peer", "flipped", "silent", "resharded")}
    for name, root in roots.items():
        shutil.copytree(four_nodes if name == "resharded" else two_nodes, root)
    shutil.rmtree(roots["peer"] / "node1")  # the replaced node's memory is empty
    shutil.rmtree(roots["silent"] / "node1")
    for node in ("node0", "node1"):  # rank 1's newest steps: its own copies and their replicas on node 0
        for step in (CRASH_STEP - 1, CRASH_STEP):
            _flip_byte(roots["flipped"] / node / "rank1" / f"step_{step:08d}" / "__0_0.distcp")
    scenarios = [
        {"root": str(roots["peer"]), "nodes": [0, 1], "fraction": 1.0},
        {"root": str(roots["flipped"]), "nodes": [0, 1], "fraction": 1.0},
        {
            "root": str(roots["silent"]),
            "nodes": [0, 1],
            "fraction": 1.0,
            "silent_holder": 0,
            "options": {"peer_timeout_s": 1.0},
        },
        # saved by 4 ranks, restored by 2: the local tier does not fit, the durable one reshards
        {"root": str(roots["resharded"]), "nodes": [0, 1], "fraction": None},
    ]
    per_rank = run_ranks(_resume, 2, args=(scenarios,))
    return {name: [results[i] for results in per_rank] for i, name in enumerate(roots)} | {"roots": roots}


@pytest.fixture(scope="module")
def four_rank_restores(four_nodes, tmp_path_factory) -> dict[str, list[dict]]:
    base = tmp_path_factory.mktemp("four_restores")
    roots = {name: base / name for name in ("one_lost", "two_lost", "intact")}
    for root in roots.values():
        shutil.copytree(four_nodes, root)
    shutil.rmtree(roots["one_lost"] / "node3")
    shutil.rmtree(roots["two_lost"] / "node0")
    shutil.rmtree(roots["two_lost"] / "node1")  # rank 0's checkpoints and their one replica (on node 1)
    scenarios = [{"root": str(root), "nodes": [0, 1, 2, 3], "fraction": None} for root in roots.values()]
    per_rank = run_ranks(_resume, 4, args=(scenarios,))
    return {name: [results[i] for results in per_rank] for i, name in enumerate(roots)}


def test_a_lost_node_resumes_from_its_peer_replica_bit_exact(two_rank_restores):
    results = two_rank_restores["peer"]
    assert [(r["step"], r["source"], r["differ"]) for r in results] == [(CRASH_STEP, "peer", [])] * 2
    # on the replaced node: rank 1's restored step and the next (the last 2 kept), and again a replica of rank 0's
    node1 = two_rank_restores["roots"]["peer"] / "node1"
    assert sorted(p.name for p in (node1 / "rank1").iterdir()) == [f"step_{s:08d}" for s in (CRASH_STEP, END_STEP)]
    assert sorted(p.name for p in (node1 / "rank0").iterdir()) == [f"step_{END_STEP:08d}"]


def test_local_checkpoints_are_checkpoints(two_nodes, cli):
    # the surviving node's copies, its own and the one it holds for rank 1, verify as any checkpoint
    for rank in (0, 1):
        cli("verify", two_nodes / "node0" / f"rank{rank}" / f"step_{CRASH_STEP:08d}")
    path = two_nodes / "node0" / "rank1" / f"step_{CRASH_STEP:08d}"
    assert checkpoint.read_manifest(path).extra_info["rank"] == 1
    state = {"extra": {"step": None}}
    checkpoint.load_state_dict(state, path)
    assert state["extra"]["step"] == CRASH_STEP


def test_a_flipped_byte_in_a_copy_and_its_replica_falls_back_to_durable(two_rank_restores):
    results = two_rank_restores["flipped"]
    assert [(r["step"], r["source"], r["differ"]) for r in results] == [(4, "durable", [])] * 2
    assert any("CRC-32 does not match" in s and "rank1" in s for s in results[0]["skipped"])


def test_a_peer_that_never_answers_is_a_bounded_wait_then_durable(two_rank_restores):
    results = two_rank_restores["silent"]
    assert [(r["step"], r["source"], r["differ"]) for r in results] == [(4, "durable", [])] * 2
    assert any("rank 0 did not send" in s for s in results[0]["skipped"])


def test_a_durable_checkpoint_reshards_when_the_world_size_changes(two_rank_restores):
    results = two_rank_restores["resharded"]
    assert [(r["step"], r["source"], r["differ"]) for r in results] == [(4, "durable", [])] * 2
    assert any("not rank 0 of 2 ranks" in s for s in results[0]["skipped"])


def test_two_nodes_lost_with_replication_1_falls_back_to_durable(four_rank_restores):
    results = four_rank_restores["two_lost"]
    assert [(r["step"], r["source"], r["differ"]) for r in results] == [(4, "durable", [])] * 4
    assert any("no verified copy of rank 0" in s for s in results[0]["skipped"])


def test_one_node_lost_of_four_resumes_from_the_peer(four_rank_restores):
    results = four_rank_restores["one_lost"]
    assert [(r["step"], r["source"], r["differ"]) for r in results] == [(CRASH_STEP, "peer", [])] * 4


def test_a_restart_with_every_node_intact_resumes_from_each_ranks_own_copy(four_rank_restores):
    results = four_rank_restores["intact"]
    assert [(r["step"], r["source"], r["differ"], r["skipped"]) for r in results] == [(CRASH_STEP, "local", [], [])] * 4


def test_one_process_keeps_the_last_local_steps_and_reports_their_memory(tmp_path, caplog):
    torch.manual_seed(0)
    model = Net()
    opt = HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), 1.0)
    tiers = checkpoint.TieredCheckpointer(tmp_path / "local", tmp_path / "durable", durable_every=2, keep_local=2)
    weights = {}
    with caplog.at_level(logging.INFO, logger="checkpoint.tiered"):
        for step in range(1, 4):
            _step(model, opt, step)
            tiers.save(step, model=model, optimizer=opt, extra={"step": step})
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        tiers.wait()
    assert any("local checkpoint tier of rank 0" in r.getMessage() and "MiB" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in (tmp_path / "local" / "rank0").iterdir()) == ["step_00000002", "step_00000003"]
    assert [p.name for p in checkpoint.committed_checkpoints(tmp_path / "durable")] == ["step_00000002"]
    # step 3: a local-only step (its own snapshot); step 2: a durable step (one snapshot for both tiers)
    for step in (3, 2):
        torch.manual_seed(1)
        fresh = Net()
        fresh_opt = HybridDeviceOptimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-2), 1.0)
        restored = tiers.restore(model=fresh, optimizer=fresh_opt)
        assert restored is not None and (restored.step, restored.source) == (step, "local")
        assert all(torch.equal(v, weights[step][k]) for k, v in fresh.state_dict().items())
        shutil.rmtree(tiers.local_path(0, step))


def test_replication_needs_more_nodes_than_copies():
    with pytest.raises(ValueError, match="replication=1 needs at least 2 nodes"):
        checkpoint.tiered.Topology.of([0, 0], 1)


def test_peers_are_on_other_nodes():
    topology = checkpoint.tiered.Topology.of([0, 0, 1, 1, 2, 2], 2)
    assert topology.peers(0) == [2, 4]
    assert topology.peers(5) == [1, 3]
    assert topology.sources(0) == [2, 4]  # rank 4 one node on, rank 2 two


def _detected_nodes(rank: int, world_size: int, tmp: str) -> dict:
    import socket

    import checkpoint.tier_topology as topology

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # torchrun's: two ranks per node
    by_local_size = topology.detect_nodes()
    del os.environ["LOCAL_WORLD_SIZE"]  # a launcher that sets nothing: the host names decide
    socket.gethostname = lambda: f"host{rank % 2}"  # this rank's process only
    by_host = topology.detect_nodes()
    tiers = checkpoint.TieredCheckpointer(Path(tmp) / "local", Path(tmp) / "durable")
    return {"local_size": by_local_size, "host": by_host, "peers": tiers.topology.peers(rank)}


def test_nodes_are_detected_from_local_world_size_else_from_host_names(tmp_path):
    results = run_ranks(_detected_nodes, world_size=4, args=(str(tmp_path),))
    assert all(r["local_size"] == [0, 0, 1, 1] for r in results)
    assert all(r["host"] == ["host0", "host1", "host0", "host1"] for r in results)
    # With the host names only, the default is one copy of each rank's checkpoints on the other host.
    assert [r["peers"] for r in results] == [[1], [0], [3], [2]]


def test_a_local_checkpoint_into_other_shapes_is_an_error_naming_the_key(tmp_path):
    model = torch.nn.Linear(4, 3)
    tiers = checkpoint.TieredCheckpointer(tmp_path / "local", tmp_path / "durable", durable_every=0)
    tiers.save(1, model=model)
    tiers.wait()
    with pytest.raises(ValueError, match=r"model\.weight: saved"):
        checkpoint.load(tiers.local_path(0, 1), model=torch.nn.Linear(4, 5), rank_local=True)


def _linear_tiers(tmp_path, durable="durable", **options):
    return checkpoint.TieredCheckpointer(tmp_path / "local", tmp_path / durable, **options)


def _saved_linear(tiers, step):
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(float(step))
    tiers.save(step, model=model)
    tiers.wait()


def test_local_copies_of_another_run_or_another_step_are_never_restored(tmp_path, caplog):
    _saved_linear(_linear_tiers(tmp_path, durable_every=0), 5)
    # Another run (by default: another durable dir) on the same node-local dir: its copy is not this run's state.
    other_run = _linear_tiers(tmp_path, durable="other-durable", durable_every=0)
    with pytest.raises(FileNotFoundError, match="not rank 0 of 1 ranks' local checkpoint of step 5 of run"):
        other_run.restore(model=torch.nn.Linear(4, 3))
    # A copy filed under another step (a replica arriving late) is not that step.
    tiers = _linear_tiers(tmp_path, durable_every=0)
    shutil.copytree(tiers.local_path(0, 5), tiers.local_path(0, 7))
    model = torch.nn.Linear(4, 3)
    with caplog.at_level(logging.WARNING, logger="checkpoint.tiered"):
        restored = tiers.restore(model=model)
    assert restored is not None and restored.step == 5
    assert torch.equal(model.weight, torch.full((3, 4), 5.0))
    assert "step_00000007" in caplog.text and "of step 7" in caplog.text


def test_a_newer_durable_checkpoint_wins_over_an_older_local_step(tmp_path):
    tiers = _linear_tiers(tmp_path, local_every=3, durable_every=4)
    for step in (3, 4):  # step 3: local only; step 4: durable only
        _saved_linear(tiers, step)
    model = torch.nn.Linear(4, 3)
    restored = tiers.restore(model=model)
    assert restored is not None and (restored.step, restored.source) == (4, "durable")
    assert torch.equal(model.weight, torch.full((3, 4), 4.0))
