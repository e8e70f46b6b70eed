"""Core binding of the host step's threads (``bind_host_cores``, offload_fsdp/core_binding.py).

The affinity is read back with ``os.sched_getaffinity`` from inside the threads that run the
host update: a delegated optimizer class (no host kernel: one instance per bucket runs its own
``step``) records it there, and a thread it starts shows what the step's own threads inherit.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.core_binding import cores_for_rank, format_cores, numa_nodes, parse_cpulist

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux thread affinity")

ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
ROOT = Path(__file__).resolve().parent.parent


class AffinityProbeSGD(torch.optim.SGD):
    """SGD whose step records (thread name, its affinity, the affinity of a thread it starts)."""

    seen: list[tuple[str, frozenset[int], frozenset[int]]] = []

    def step(self, closure=None):
        child: list[frozenset[int]] = []
        started = threading.Thread(target=lambda: child.append(frozenset(os.sched_getaffinity(0))))
        started.start()
        started.join()
        AffinityProbeSGD.seen.append((threading.current_thread().name, frozenset(os.sched_getaffinity(0)), child[0]))
        return super().step(closure)


def _train(opt_kwargs: dict, steps: int = 2) -> tuple[HybridDeviceOptimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = HybridDeviceOptimizer(model.parameters(), cpu_optimizer_cls=AffinityProbeSGD, lr=0.1, momentum=0.9,
                                bucket_numel=64, **opt_kwargs)  # fmt: skip
    for _ in range(steps):
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return opt, [p.detach().clone() for p in model.parameters()]


def _as_local_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))


@pytest.mark.parametrize("overlapped", [False, True], ids=["after_backward", "overlapped"])
def test_host_step_threads_run_on_the_local_ranks_cores_and_the_callers_thread_keeps_its_own(monkeypatch, overlapped):
    _as_local_rank(monkeypatch, len(ALLOWED) - 1, len(ALLOWED))  # the last local rank: one core of its own
    expected = cores_for_rank(ALLOWED, numa_nodes(), len(ALLOWED) - 1, len(ALLOWED))
    AffinityProbeSGD.seen.clear()
    opt, bound = _train({"bind_host_cores": True, "overlap_step_with_backward": overlapped})
    assert opt.host_cores == expected and len(expected) == 1
    assert AffinityProbeSGD.seen, "the host update never ran"
    for thread, affinity, child in AffinityProbeSGD.seen:
        assert thread != threading.main_thread().name
        assert affinity == expected and child == expected, (thread, affinity, child)
    assert frozenset(os.sched_getaffinity(0)) == ALLOWED  # the training loop's thread is left alone
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    AffinityProbeSGD.seen.clear()
    opt, unbound = _train({"bind_host_cores": False, "overlap_step_with_backward": overlapped})
    assert opt.host_cores is None
    assert all(affinity == ALLOWED for _, affinity, _ in AffinityProbeSGD.seen)
    assert all(torch.equal(a, b) for a, b in zip(bound, unbound))  # binding moves threads, never bits


def test_the_default_binds_nothing_even_with_several_local_ranks_and_says_so(monkeypatch, caplog):
    # opt-in: a bound step measured 5.5x slower at two local ranks on a 16-core host (docs/offload.md)
    caplog.set_level(logging.INFO, logger="offload_fsdp.optimizer")
    for world in (1, 2, max(2, len(ALLOWED) // 2)):
        _as_local_rank(monkeypatch, 0, world)
        caplog.clear()
        opt, _ = _train({}, steps=0)
        assert opt.host_cores is None
        assert "host step cores not bound (bind_host_cores=None: binding is opt-in, pass True)" in caplog.text
    opt, _ = _train({"bind_host_cores": True}, steps=0)
    assert opt.host_cores == cores_for_rank(ALLOWED, numa_nodes(), 0, max(2, len(ALLOWED) // 2))


def test_binding_with_fewer_cores_than_local_ranks_is_an_error_naming_the_counts(monkeypatch):
    _as_local_rank(monkeypatch, 0, len(ALLOWED) + 1)
    with pytest.raises(ValueError, match=rf"{len(ALLOWED)} allowed cores .* {len(ALLOWED) + 1} local ranks"):
        _train({"bind_host_cores": True}, steps=0)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two allowed cores to restrict the mask to one")
def test_a_mask_set_by_the_user_is_kept_by_default_and_split_when_binding_is_asked(monkeypatch):
    _as_local_rank(monkeypatch, 1, 2)
    user_mask = frozenset(sorted(ALLOWED)[:1])
    os.sched_setaffinity(0, user_mask)  # as taskset would; this thread only, restored below
    try:
        opt, _ = _train({}, steps=0)
        assert opt.host_cores is None
        with pytest.raises(ValueError, match="1 allowed cores"):  # one core cannot be split between two ranks
            _train({"bind_host_cores": True}, steps=0)
    finally:
        os.sched_setaffinity(0, ALLOWED)


def test_each_local_rank_gets_a_disjoint_share_and_together_all_cores():
    nodes = [frozenset(range(0, 4)), frozenset(range(4, 8))]
    allowed = frozenset(range(8))
    for world in range(1, 9):
        shares = [cores_for_rank(allowed, nodes, rank, world) for rank in range(world)]
        assert all(shares) and sum(len(s) for s in shares) == len(allowed) and frozenset().union(*shares) == allowed
    # NUMA-local where the ranks divide among the nodes: each share inside one node
    for world in (2, 4, 8):
        for rank in range(world):
            share = cores_for_rank(allowed, nodes, rank, world)
            assert any(share <= node for node in nodes), (world, rank, share)
    assert cores_for_rank(allowed, nodes, 1, 2) == nodes[1]
    # a restricted mask (3 cores of node 0, 1 of node 1): shares come from it only
    restricted = frozenset({0, 1, 2, 6})
    assert [cores_for_rank(restricted, nodes, r, 2) for r in range(2)] == [frozenset({0, 1, 2}), frozenset({6})]


def test_numa_nodes_are_read_from_sysfs_cpulists_and_memory_only_nodes_are_skipped(tmp_path):
    for index, cpulist in [(0, "0-3,8-11\n"), (1, "4-7,12-15\n"), (2, "\n"), (10, "16\n")]:
        (tmp_path / f"node{index}").mkdir()
        (tmp_path / f"node{index}" / "cpulist").write_text(cpulist)
    assert numa_nodes(tmp_path) == [parse_cpulist("0-3,8-11"), parse_cpulist("4-7,12-15"), frozenset({16})]
    assert numa_nodes(tmp_path / "absent") == []
    assert format_cores(parse_cpulist("0-3,8-11,16")) == "0-3,8-11,16"


_RANK_SCRIPT = """
import json, os, sys, threading
sys.path.insert(0, {root!r})
import torch
from offload_fsdp import HybridDeviceOptimizer
from tests.test_offload_core_binding import AffinityProbeSGD
model = torch.nn.Linear(8, 8)
auto = HybridDeviceOptimizer(model.parameters(), cpu_optimizer_cls=AffinityProbeSGD, lr=0.1).host_cores
opt = HybridDeviceOptimizer(model.parameters(), cpu_optimizer_cls=AffinityProbeSGD, lr=0.1, bind_host_cores=True)
model(torch.randn(2, 8)).sum().backward()
opt.step()
out = {{"rank": os.environ["LOCAL_RANK"], "chosen": sorted(opt.host_cores), "auto": sorted(auto or []),
       "seen": [sorted(a) for _, a, _ in AffinityProbeSGD.seen], "children": [sorted(c) for _, _, c in AffinityProbeSGD.seen],
       "main": sorted(os.sched_getaffinity(0))}}
open(os.path.join({out!r}, os.environ["LOCAL_RANK"] + ".json"), "w").write(json.dumps(out))
"""


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs a core for each of two local ranks")
def test_two_local_ranks_under_torchrun_bind_to_disjoint_cores(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT.format(root=str(ROOT), out=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    subprocess.run(command, check=True, env=env, timeout=240, capture_output=True)
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    chosen = [frozenset(r["chosen"]) for r in ranks]
    assert chosen[0] and chosen[1] and not chosen[0] & chosen[1] and chosen[0] | chosen[1] <= ALLOWED
    for r, cores in zip(ranks, chosen):
        assert r["seen"] and all(frozenset(a) == cores for a in r["seen"] + r["children"])
        assert frozenset(r["main"]) == ALLOWED
        assert r["auto"] == []  # the default binds nothing
