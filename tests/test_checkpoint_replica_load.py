"""Load once per replica: on a 2x2 (replicate x shard) HSDP mesh one replica reads, the other receives.

Bytes read from storage are counted per rank through a mounted :class:`~checkpoint.storage_backend.Storage`
(the public backend interface); results are compared bit for bit with the plain load (every rank reads)
and with the single-process model that was saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import checkpoint
from checkpoint.storage_backend import mount, unmount
from tests.distributed import run_ranks
from tests.read_counting import ReadCountingStorage
from tests.test_checkpoint_dist import Net  # uneven and empty shards over the 2 shard ranks

pytestmark = pytest.mark.slow


def _hsdp(seed: int):
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for module in (*model.blocks, model.head, model):
        fully_shard(module, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _local_state(model, opt) -> dict[str, torch.Tensor]:
    """Every local tensor of model and optimizer, by name (plain tensors: comparable bit for bit)."""
    out = {f"model.{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            out[f"optimizer.{names[id(p)]}.{key}"] = local.detach().clone()
    return out


def _load_counted(root: Path, path: Path, seed: int, **kwargs):
    model, opt = _hsdp(seed)
    storage = ReadCountingStorage(kwargs.pop("fail", ()))
    mount(root, storage)
    try:
        checkpoint.load(path, model=model, optimizer=opt, **kwargs)
    finally:
        unmount(root)
    return model, opt, storage.data_bytes()


def _replica_body(rank: int, world_size: int, root: str) -> dict:
    root_path = Path(root)
    model, opt = _hsdp(0)
    for seed in (1, 2):
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(root_path / "ck", model=model, optimizer=opt)
    saved = _local_state(model, opt)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # the single-process view
    shared, shared_opt, shared_bytes = _load_counted(root_path, root_path / "ck", 9)
    plain, plain_opt, plain_bytes = _load_counted(root_path, root_path / "ck", 9, read_once_per_replica=False)
    shared_state, plain_state = _local_state(shared, shared_opt), _local_state(plain, plain_opt)
    ddp_bytes, ddp_loaded = _ddp_load(root_path, world_size)
    return {
        "ddp_bytes": ddp_bytes,
        "ddp_loaded": ddp_loaded,
        "coordinate": init_device_mesh("cpu", (2, 2)).get_coordinate(),
        "shared_bytes": shared_bytes,
        "plain_bytes": plain_bytes,
        "keys": sorted(shared_state) == sorted(plain_state) == sorted(saved),
        "differs_from_plain": [k for k in plain_state if not torch.equal(shared_state[k], plain_state[k])],
        "differs_from_saved": [k for k in saved if not torch.equal(shared_state[k], saved[k])],
        "differs_from_full": [n for n, p in shared.named_parameters() if not torch.equal(p.full_tensor(), full[n])],
    }


def _ddp_load(root: Path, world_size: int) -> tuple[int, bool]:
    """DDP on a 1-D mesh (every rank a replica), through load_state_dict, with a plain tensor and a value."""
    mesh = init_device_mesh("cpu", (world_size,))
    weight = torch.arange(24.0).reshape(6, 4)
    saved = {"w": distribute_tensor(weight, mesh, [Replicate()]), "step": torch.tensor(7.0), "note": "replicated"}
    checkpoint.save_state_dict(saved, root / "ddp")
    target = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()]), "step": torch.tensor(0.0), "note": None}
    storage = ReadCountingStorage()
    mount(root, storage)
    try:
        checkpoint.load_state_dict(target, root / "ddp")
    finally:
        unmount(root)
    loaded = torch.equal(target["w"].to_local(), weight) and target["step"].item() == 7.0
    return storage.data_bytes(), loaded and target["note"] == "replicated"


def test_replicas_read_each_byte_once_and_load_bit_for_bit_what_every_rank_reading_loads(tmp_path):
    results = run_ranks(_replica_body, 4, args=(str(tmp_path),), timeout_s=300)
    for rank, r in enumerate(results):
        assert r["keys"], rank
        assert r["differs_from_plain"] == [] and r["differs_from_saved"] == [] and r["differs_from_full"] == [], (
            rank,
            r,
        )
        if r["coordinate"][0] == 0:  # the reading replica reads what it read before
            assert r["shared_bytes"] == r["plain_bytes"] > 0, (rank, r)
        else:  # the other replica reads no data file at all: it receives
            assert r["shared_bytes"] == 0 < r["plain_bytes"], (rank, r)
    assert all(r["ddp_loaded"] for r in results)
    assert results[0]["ddp_bytes"] > 0 and [r["ddp_bytes"] for r in results[1:]] == [0, 0, 0]  # DDP: rank 0 reads
    shared = sum(r["shared_bytes"] for r in results)
    plain = sum(r["plain_bytes"] for r in results)
    assert 2 * shared == plain  # bytes read from storage per rank halve


def _failing_body(rank: int, world_size: int, root: str) -> list[str]:
    root_path = Path(root)
    model, opt = _hsdp(0)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    checkpoint.save(root_path / "ck", model=model, optimizer=opt)
    outcomes = []
    for failing_rank, fail in _FAILURES:
        try:
            _load_counted(root_path, root_path / "ck", 9, fail=(fail,) if rank == failing_rank else ())
            outcomes.append("loaded")
        except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
            outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


_FAILURES = [
    (1, ".distcp"),  # a reading replica fails its read: its partner must not wait for a broadcast
    (3, "manifest.json"),  # a receiving replica fails to open the checkpoint, before the others' reads
]


def test_a_failed_read_on_one_rank_raises_on_every_rank_with_replicas_sharing(tmp_path):
    results = run_ranks(_failing_body, 4, args=(str(tmp_path),), timeout_s=300)
    for case, (failing_rank, _) in enumerate(_FAILURES):
        for rank, outcomes in enumerate(results):
            outcome = outcomes[case]
            if rank == failing_rank:
                assert "injected by the test" in outcome, outcome
            else:
                assert outcome.startswith("CheckpointLoadError") and f"rank {failing_rank}" in outcome, (rank, outcome)
