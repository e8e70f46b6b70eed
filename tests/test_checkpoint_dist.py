"""fsdp_dtensor over gloo: FSDP2 / flat-shard / single process, N -> M ranks, interop, collective counts.

Three rank launches (2, 4 and 3 ranks) share one directory, in that order,
plus single-process loads in the test process; each launch batches its checks.
"""

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import checkpoint
from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.shard_spec import ShardSpec, attach_shard_spec, shard_spec_of
from tests.distributed import count_collectives, run_ranks

pytestmark = pytest.mark.slow


class Net(torch.nn.Module):
    """dim 0 of 5, 3 and 1 rows: uneven shards on 2-4 ranks, and empty ones (head.weight has 1 row)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)])
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.blocks[1](torch.relu(self.blocks[0](x))))


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _fsdp(model: Net, world_size: int) -> Net:
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, seeds) -> None:
    for seed in seeds:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state tensor, gathered (FSDP2) or as is (single process)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = _full(p)
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = _full(value)
    return out


def _portable(state: dict[str, torch.Tensor]) -> dict:
    # numpy pickles by value: a tensor sent from a rank that exits right after is shared memory
    # (torch.multiprocessing) and can be lost on the way to the test process.
    return {k: v.detach().numpy() for k, v in state.items()}


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in state.items()}


def _mismatches(model, opt, ref: dict[str, torch.Tensor]) -> list[str]:
    """Names whose local data differ from ``ref`` (flat-shard params compared on their range)."""
    bad = []
    got = {}
    for name, p in model.named_parameters():
        spec = shard_spec_of(p)
        got[name] = (p, spec)
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                got[f"{name}.{key}"] = (value, spec if key != "step" else None)
    for name, (value, spec) in got.items():
        if spec is not None and spec.is_flat:
            ok = torch.equal(value.detach(), ref[name].reshape(-1)[spec.flat_start : spec.flat_start + value.numel()])
        else:
            ok = torch.equal(_full(value), ref[name])
        if not ok:
            bad.append(name)
    missing = sorted(set(ref) - set(got))
    return bad + [f"{m} (missing)" for m in missing]


def _count_collectives(fn) -> Counter:
    """Calls to torch.distributed's collectives while ``fn`` runs."""
    return count_collectives(fn).calls


def _many_tensors_state(rank: int, world_size: int, n: int) -> dict:
    state = {}
    for i in range(n):
        rows = 2 + i % 3
        state[f"t{i}"] = checkpoint.shard(
            torch.full((rows, 4), float(i)), (rows * world_size, 4), offsets=(rank * rows, 0)
        )
    return state


def _two_rank_body(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    model = _fsdp(_net(0), world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, [1, 2])
    ref = _full_state(model, opt)
    checkpoint.save(root / "a", model=model, optimizer=opt, extra={"step": 2})
    checkpoint.save(root / "b", model=model, optimizer=opt, extra={"step": 2})
    checkpoint.save(root / "s", model=model, optimizer=opt, extra={"step": 2}, mode="scale")
    dist.barrier()  # scale mode: rank 0 commits after the save's barrier

    # plain FSDP2 + AdamW checkpoint, torch's default layout
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=root / "plain")

    results = {"ref": _portable(ref) if rank == 0 else None}
    if rank == 0:
        names = sorted(os.listdir(root / "a"))
        results["identical"] = names == sorted(os.listdir(root / "b")) and all(
            (root / "a" / n).read_bytes() == (root / "b" / n).read_bytes() for n in names
        )
        results["files"] = names

    # collectives per save do not grow with the number of tensors
    counts = {}
    for n in (8, 200):
        state = _many_tensors_state(rank, world_size, n)
        counts[f"collective{n}"] = _count_collectives(lambda: checkpoint.save_state_dict(state, root / f"n{n}"))
        counts[f"scale{n}"] = _count_collectives(
            lambda: checkpoint.save_state_dict(state, root / f"m{n}", mode="scale")
        )
        dist.barrier()
        target = {
            k: checkpoint.shard(torch.zeros_like(v.local), v.shape, offsets=v.spec.offsets) for k, v in state.items()
        }
        counts[f"load{n}"] = _count_collectives(lambda: checkpoint.load_state_dict(target, root / f"m{n}"))
        assert all(torch.equal(target[k].local, state[k].local) for k in state)
    results["counts"] = counts

    # bit-exact resume at the same world size
    _train(model, opt, [3, 4])
    after = _full_state(model, opt)
    model2 = _fsdp(_net(7), world_size)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, weight_decay=0.1)
    extra = checkpoint.load(root / "a", model=model2, optimizer=opt2)
    assert extra["step"] == 2
    _train(model2, opt2, [3, 4])
    results["resume_mismatches"] = _mismatches(model2, opt2, after)
    results["hybrid"] = _hybrid_resume(root, world_size)
    return results


def _hybrid_resume(root: Path, world_size: int):
    """Save / load / continue with HybridDeviceOptimizer; also load the plain AdamW checkpoint into it."""
    model = _fsdp(_net(0), world_size)
    opt = HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), offload_fraction=1.0)
    _train(model, opt, [1, 2])
    checkpoint.save(root / "h", model=model, optimizer=opt)
    _train(model, opt, [3, 4])
    after = _full_state(model, opt)
    model2 = _fsdp(_net(5), world_size)
    opt2 = HybridDeviceOptimizer(torch.optim.AdamW(model2.parameters(), lr=0.3, weight_decay=0.1), offload_fraction=1.0)
    checkpoint.load(root / "h", model=model2, optimizer=opt2)
    _train(model2, opt2, [3, 4])
    model3 = _fsdp(_net(6), world_size)
    opt3 = HybridDeviceOptimizer(torch.optim.AdamW(model3.parameters(), lr=0.3, weight_decay=0.1), offload_fraction=1.0)
    checkpoint.load(root / "a", model=model3, optimizer=opt3)  # written with plain AdamW
    loaded = _full_state(model3, opt3)  # a collective: every rank gathers
    return {
        "resume": _mismatches(model2, opt2, after),
        "from_adamw": _portable(loaded) if dist.get_rank() == 0 else None,
    }


def _flat_bounds(numel: int, world_size: int) -> list[int]:
    """Uneven cut points with empty ranges: rank 1 gets nothing, the last rank the most."""
    cuts = [0, numel // 3, numel // 3] + [min(numel, numel // 3 + (i + 1) * 2) for i in range(world_size - 3)]
    return sorted(min(c, numel) for c in cuts[:world_size]) + [numel]


def _flat_model(full: Net, rank: int, world_size: int) -> Net:
    """``full``'s params replaced by flat ranges of them (flat-buffer FSDP), tagged with a ShardSpec."""
    for module in full.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            bounds = _flat_bounds(p.numel(), world_size)
            lo, hi = bounds[rank], bounds[rank + 1]
            local = torch.nn.Parameter(p.detach().reshape(-1)[lo:hi].clone())
            attach_shard_spec(local, ShardSpec(tuple(p.shape), flat_start=lo))
            module._parameters[name] = local
    return full


def _flat_grads(full: Net, flat: Net) -> None:
    for p, q in zip(full.parameters(), flat.parameters()):
        spec = shard_spec_of(q)
        q.grad = p.grad.reshape(-1)[spec.flat_start : spec.flat_start + q.numel()].clone()


def _four_rank_body(rank: int, world_size: int, root: str, ref_a: dict) -> dict:
    root, ref_a = Path(root), _tensors(ref_a)
    # The same full model and gradients on every rank; each rank steps its flat ranges only.
    full = _net(3)
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    flat = _flat_model(_net(3), rank, world_size)
    flat_opt = torch.optim.AdamW(flat.parameters(), lr=1e-2)
    for seed in (1, 2):
        full(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        _flat_grads(full, flat)
        full_opt.step()
        flat_opt.step()
        full_opt.zero_grad()
        flat_opt.zero_grad()
    ref_flat = _full_state(full, full_opt)
    checkpoint.save(root / "flat4", model=flat, optimizer=flat_opt, extra={"layout": "flat"})
    # row blocks (FSDP2 at 2 ranks) -> flat ranges at 4 ranks, with empty ranges
    target = _flat_model(_net(8), rank, world_size)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.3)
    checkpoint.load(root / "a", model=target, optimizer=target_opt)
    # HSDP (2 replicas x 2 shards): each replicated shard is written once, in both modes
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = _net(4)
    for module in (*hsdp.blocks, hsdp.head, hsdp):
        fully_shard(module, mesh=mesh)
    checkpoint.save(root / "hsdp", model=hsdp)
    checkpoint.save(root / "hsdp_scale", model=hsdp, mode="scale")
    dist.barrier()
    return {
        "ref_flat": _portable(ref_flat) if rank == 0 else None,
        "flat_from_fsdp": _mismatches(target, target_opt, ref_a),
    }


def _three_rank_body(rank: int, world_size: int, root: str, ref_a: dict, ref_flat: dict) -> dict:
    root, ref_a, ref_flat = Path(root), _tensors(ref_a), _tensors(ref_flat)
    out = {}
    for name, source, ref, kwargs in (
        ("fsdp2", "a", ref_a, {}),
        ("scale", "s", ref_a, {}),
        ("flat4", "flat4", ref_flat, {}),
        ("plain", "plain", ref_a, {"require_manifest": False}),
    ):
        model = _fsdp(_net(9), world_size)
        opt = torch.optim.AdamW(model.parameters(), lr=0.3)
        checkpoint.load(root / source, model=model, optimizer=opt, **kwargs)
        out[name] = _mismatches(model, opt, ref)
    for source in ("hsdp", "hsdp_scale"):
        model = _fsdp(_net(9), world_size)
        checkpoint.load(root / source, model=model)
        out[source] = [n for n, p in model.named_parameters() if not torch.equal(_full(p), _net(4).get_parameter(n))]
    # async save at 3 ranks: staged now, written by a background thread on its own gloo group
    model = _fsdp(_net(9), world_size)
    checkpoint.load(root / "a", model=model)
    future = checkpoint.async_save(root / "async3", model=model, extra={"step": 2})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # after staging: must not reach the checkpoint
    future.result(timeout=120)
    dist.barrier()
    reloaded = _fsdp(_net(10), world_size)
    checkpoint.load(root / "async3", model=reloaded)
    out["async"] = [n for n, p in reloaded.named_parameters() if not torch.equal(_full(p), ref_a[n])]
    # the same with no staging copies: the caller waits until its live shards are written
    model = _fsdp(_net(9), world_size)
    checkpoint.load(root / "a", model=model)
    future = checkpoint.async_save(root / "async3b", model=model, max_staging_bytes=0, mode="scale")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    future.result(timeout=120)
    dist.barrier()
    reloaded = _fsdp(_net(10), world_size)
    checkpoint.load(root / "async3b", model=reloaded)
    out["async"] += [n for n, p in reloaded.named_parameters() if not torch.equal(_full(p), ref_a[n])]
    # plain DCP reads ours at another world size
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    model = _fsdp(_net(9), world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=0.3)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=root / "a")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    out["plain_dcp_reads_ours"] = _mismatches(model, opt, ref_a)
    return out


def test_checkpoints_move_between_fsdp2_flat_shards_and_world_sizes(tmp_path):
    root = str(tmp_path)
    two = run_ranks(_two_rank_body, 2, args=(root,))
    ref_a = two[0]["ref"]
    assert two[0]["identical"], two[0]["files"]
    assert all(r["resume_mismatches"] == [] for r in two)

    counts = two[0]["counts"]
    # DCP's fixed exchange (4) plus one gather agreeing every rank's values can be saved (issue 25.2)
    assert counts["collective8"] == counts["collective200"] and sum(counts["collective8"].values()) <= 5
    # scale mode: agree on the prepared target, on every rank's writes, on rank 0's commit (errors reach every rank)
    assert counts["scale8"] == counts["scale200"] == Counter(all_gather_object=3)
    # a load: one small gather agreeing on success (a damaged file one rank read raises on every rank)
    assert counts["load8"] == counts["load200"] == Counter(all_gather_object=1)

    four = run_ranks(_four_rank_body, 4, args=(root, ref_a))
    assert all(r["flat_from_fsdp"] == [] for r in four)
    ref_flat = four[0]["ref_flat"]

    three = run_ranks(_three_rank_body, 3, args=(root, ref_a, ref_flat))
    ref_a, ref_flat = _tensors(ref_a), _tensors(ref_flat)
    for result in three:
        assert result == {
            "fsdp2": [],
            "scale": [],
            "flat4": [],
            "plain": [],
            "hsdp": [],
            "hsdp_scale": [],
            "async": [],
            "plain_dcp_reads_ours": [],
        }
    for source in ("hsdp", "hsdp_scale"):  # every stored byte is referenced once: no replica written twice
        data_bytes = sum(f.stat().st_size for f in (tmp_path / source).glob("*.distcp"))
        storage = checkpoint.open_checkpoint(tmp_path / source).metadata.storage_data
        assert sum(info.length for info in storage.values()) == data_bytes, source

    # ... and a single process, no process group
    for source, ref in (("a", ref_a), ("flat4", ref_flat)):
        model = _net(11)
        opt = torch.optim.AdamW(model.parameters(), lr=0.3)
        extra = checkpoint.load(tmp_path / source, model=model, optimizer=opt)
        assert _mismatches(model, opt, ref) == [], source
    assert extra == {"layout": "flat"}

    hybrid = two[0]["hybrid"]
    assert hybrid["resume"] == []
    loaded = _tensors(hybrid["from_adamw"])
    for name, value in ref_a.items():
        assert torch.equal(loaded[name], value), name
