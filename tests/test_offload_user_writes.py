"""Weights the user writes between steps are never reverted by a stale master.

Every write below (a model ``load_state_dict``, ``copy_``, ``mul_``, an EMA swap in and
out) happens between two steps with no ``reload_model_params()`` call; the optimizer
must notice it by itself (the params' version counters) and continue from the written
values exactly as torch's AdamW does. For bf16 params the reference is an fp32 AdamW
(the master); a written element replaces the master where its value differs from the
master's cast, and every other element keeps the master's precision.
"""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.placement import Placement
from tests.distributed import run_ranks

WRITES = ["load_state_dict", "copy_", "mul_", "ema_swap"]
HYPER = {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.1, "fused": True}  # both shares: torch's fused kernel


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


@torch.no_grad()
def _write(kind: str, model: torch.nn.Module) -> None:
    """The user's in-place write; deterministic, so applying it to two models writes the same values."""
    params = list(model.parameters())
    if kind == "load_state_dict":
        model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    elif kind == "copy_":
        gen = torch.Generator().manual_seed(5)
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.randn(local.shape, generator=gen).to(p.dtype))
    elif kind == "mul_":
        for p in params:
            p.mul_(0.5)
    elif kind == "ema_swap":  # evaluate with EMA weights, then swap the trained ones back in
        ema = [p.detach().clone().mul_(0.9) for p in params]
        trained = [p.detach().clone() for p in params]
        for p, e in zip(params, ema):
            p.copy_(e)
        for p, t in zip(params, trained):
            p.copy_(t)


@torch.no_grad()
def _as_master_reference(ref: torch.nn.Module, ours: torch.nn.Module) -> None:
    """bf16 reference: the fp32 master takes the written bf16 value where it differs from the master's cast."""
    for r, p in zip(ref.parameters(), ours.parameters()):
        r_local, p_local = (r.to_local(), p.to_local()) if hasattr(r, "to_local") else (r, p)
        r_local.copy_(torch.where(r_local.to(p.dtype) != p_local, p_local.float(), r_local))


def _write_like_torch(kind: str, ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    """The user's write into ``ours``, and what it does to the fp32 reference ``ref`` (the params, or the master)."""
    _write(kind, ours)
    if next(ours.parameters()).dtype == torch.float32:
        _write(kind, ref)
    else:
        _as_master_reference(ref, ours)


def _set_grads(models: list[torch.nn.Module], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for params in zip(*(m.parameters() for m in models)):
        g = torch.randn(params[0].shape, generator=gen).to(params[0].dtype)
        for p in params:
            p.grad = g.to(p.dtype)


@pytest.mark.parametrize("kind", WRITES)
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_weight_written_between_steps_is_kept_like_torch(kind, fraction, dtype):
    ours = _model(dtype)
    ref = _model(dtype).float()  # fp32 params: torch AdamW itself; bf16: the fp32 master it follows
    opt = HybridDeviceOptimizer(torch.optim.AdamW(ours.parameters(), **HYPER), fraction, bucket_numel=16)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for step in range(4):
        if step == 2:
            _write_like_torch(kind, ours, ref)
        _set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
    for p, r in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p if dtype == torch.float32 else opt.state[p]["master_param"], r), "bit for bit"
        if dtype != torch.float32:
            assert torch.equal(p, opt.state[p]["master_param"].to(dtype)), "the param is its master's cast"


def test_a_master_in_state_dict_reflects_a_weight_written_since_the_last_step():
    model = _model(torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=0.01)
    _set_grads([model], 0)
    opt.step()
    _write("load_state_dict", model)
    for state in opt.state_dict()["state"].values():
        assert torch.equal(state["master_param"], torch.zeros_like(state["master_param"])), "a stale master is saved"


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW])
def test_a_step_adopts_a_weight_written_into_a_param_that_gets_no_grad_that_step(cls, fraction):
    """torch leaves a gradless param as the user wrote it; its master in ``opt.state`` must say the same."""
    model = _model(torch.bfloat16)
    opt = HybridDeviceOptimizer(cls(model.parameters(), lr=0.01), fraction, bucket_numel=64)
    _set_grads([model], 0)
    opt.step()
    _write("copy_", model)
    written = [p.detach().clone() for p in model.parameters()]
    _set_grads([model], 1)
    gradless = list(model.parameters())[::2]
    for p in gradless:
        p.grad = None
    opt.step()
    for p, w in zip(model.parameters(), written):
        if any(p is q for q in gradless):
            assert torch.equal(p, w), "a gradless param keeps the user's write"
            assert torch.equal(opt.state[p]["master_param"], w.float()), "a stale master in opt.state"


def test_steps_without_writes_do_not_refresh_masters(monkeypatch):
    model = _model(torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), 0.5, lr=0.01)
    _set_grads([model], 0)
    opt.step()  # the first step compares every master once (weights may have been loaded since construction)
    calls = _counting_refreshes(monkeypatch)
    for step in range(1, 3):
        _set_grads([model], step)
        opt.step()
    assert calls == [], "the optimizer's own write-back must not count as a user write"


def _counting_refreshes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every master refresh from now on logs its size (records refreshed) into the returned list."""
    calls: list[int] = []
    refresh = Placement.refresh_masters

    def counted(self, records):
        calls.append(len(records))
        refresh(self, records)

    monkeypatch.setattr(Placement, "refresh_masters", counted)
    return calls


def _fsdp_case(mesh, rank: int, dtype: torch.dtype, kind: str, fraction: float) -> tuple[float, int]:
    """(max |master - torch AdamW| after 4 steps with a write before the 3rd, refreshes in a step without writes)."""
    from torch.distributed.fsdp import fully_shard

    def sharded(upcast: bool):
        model = _model(dtype).float() if upcast else _model(dtype)
        fully_shard(model[0], mesh=mesh)
        return fully_shard(model, mesh=mesh)

    ours, ref = sharded(upcast=False), sharded(upcast=True)  # ref: torch AdamW (for bf16: the master)
    opt = HybridDeviceOptimizer(torch.optim.AdamW(ours.parameters(), **HYPER), fraction)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    patch = pytest.MonkeyPatch()
    calls = _counting_refreshes(patch)
    refreshes_without_writes = 0
    for step in range(4):
        if step == 2:
            _write_like_torch(kind, ours, ref)
        calls.clear()
        gen = torch.Generator().manual_seed(100 * step + rank)
        ours(torch.randn(4, 6, generator=gen).to(dtype)).float().square().mean().backward()
        for p, r in zip(ours.parameters(), ref.parameters()):
            r.grad = p.grad.float()  # the same (reduce-scattered) grads, upcast
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        if step == 1:  # after the first step's one-time pass, before any write
            refreshes_without_writes = len(calls)
    patch.undo()
    masters = [opt.state[p].get("master_param", p) for p in ours.parameters()]
    diff = max(
        (a.to_local().float() - b.to_local()).abs().max().item() if a.to_local().numel() else 0.0
        for a, b in zip(masters, ref.parameters())
    )
    return diff, refreshes_without_writes


def _fsdp_body(rank: int, world_size: int, kinds: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    return {
        f"{dtype}-{kind}@{fraction}": _fsdp_case(mesh, rank, dtype, kind, fraction)
        for dtype in (torch.float32, torch.bfloat16) for kind in kinds for fraction in (0.5, 1.0)
    }  # fmt: skip


def test_fsdp2_local_shards_written_between_steps_are_kept_like_torch():
    for cases in run_ranks(_fsdp_body, world_size=2, args=(WRITES,)):
        assert max(diff for diff, _ in cases.values()) == 0.0, cases  # bit for bit
        assert all(refreshes == 0 for _, refreshes in cases.values()), "FSDP2's own work must not count as a user write"
