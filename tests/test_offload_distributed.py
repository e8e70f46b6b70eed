"""HybridDeviceOptimizer on sharded parameters: FSDP2 over gloo (uneven, empty shards, HSDP) and flat shards."""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer
from offload_fsdp.copy_engine import SyncCopyEngine
from offload_fsdp.shard_spec import ShardSpec, attach_shard_spec, shard_spec_of
from tests.distributed import run_ranks

LR = 0.01


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Row counts 5, 3, 2 and 1 force uneven shards, and empty ones on 3 and 4 ranks.
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(),
        torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1),
    )  # fmt: skip


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, opt, steps, rank, start=0, micro_batches=1):
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        for _ in range(micro_batches):
            model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _max_diff(a, b) -> float:
    return max((x.full_tensor() - y.full_tensor()).abs().max().item() for x, y in zip(a, b))


def _dcp_in_place_round_trip(model, osd, mesh, tmp: str, out: dict) -> None:
    """dcp.save the optimizer state, dcp.load it IN PLACE into a fresh optimizer's materialised
    host state (the DTensors returned by get_state_dict wrap the optimizer's own buffers), then
    set_state_dict. The fresh model is stashed in ``out`` and trained alongside for comparison."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dsd

    dcp.save({"optim": osd}, checkpoint_id=tmp)
    fresh = _shard(_model(seed=7), mesh)
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), model.parameters()):
            p.copy_(q)
    fresh_opt = HybridDeviceOptimizer(fresh.parameters(), 1.0, lr=0.5, weight_decay=0.1)
    fresh_opt.materialize_state()
    _, fresh_osd = dsd.get_state_dict(fresh, fresh_opt)  # state exists: no zero-grad init step
    dcp.load({"optim": fresh_osd}, checkpoint_id=tmp)
    out["dcp_loaded_in_place"] = all(  # before set_state_dict: the load wrote our host buffers directly
        torch.equal(fresh_opt.state[p][k].to_local(), osd["state"][fqn][k].to_local())
        for (fqn, _), p in zip(model.named_parameters(), fresh.parameters()) for k in ("exp_avg", "exp_avg_sq")
    )  # fmt: skip
    dsd.set_state_dict(fresh, fresh_opt, model_state_dict={}, optim_state_dict=fresh_osd)
    assert fresh_opt.param_groups[0]["lr"] == LR
    out["dcp_model"] = (fresh, fresh_opt)


def _fsdp_body(rank: int, world_size: int, mesh_shapes: list[tuple[int, ...]], tmp: str) -> list[dict]:
    return [_fsdp_case(rank, world_size, shape, f"{tmp}/{i}") for i, shape in enumerate(mesh_shapes)]


def _fsdp_case(rank: int, world_size: int, mesh_shape: tuple[int, ...], tmp: str) -> dict:
    import torch.distributed.checkpoint.state_dict as dsd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    out: dict = {"empty_local_shards": 0}

    ref = _shard(_model(), mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    _train(ref, ref_opt, 2, rank)
    for fraction in (0.5, 1.0):  # 0.0 is plain AdamW on the local shards, covered by the CPU parity tests
        model = _shard(_model(), mesh)
        opt = HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), fraction)
        out["empty_local_shards"] = sum(p.to_local().numel() == 0 for p in model.parameters())
        staged: list[int] = []
        with pytest.MonkeyPatch.context() as m:
            stage_grad = SyncCopyEngine.stage_grad
            m.setattr(SyncCopyEngine, "stage_grad", lambda self, *a: (staged.append(1), stage_grad(self, *a))[1])
            model(torch.randn(2, 6)).sum().backward()
        # FSDP2 runs post-accumulate-grad hooks on the reduced sharded grads: D2H starts in backward
        out["staged_in_backward"] = len(staged) == sum(opt.layout().offloaded)
        opt.zero_grad()
        _train(model, opt, 2, rank)
        out[f"param_diff_{fraction}"] = _max_diff(model.parameters(), ref.parameters())
        state = opt.state[next(model.parameters())]
        assert (
            isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == next(model.parameters()).placements
        )
        assert state["exp_avg"].to_local().device.type == "cpu"

    # DCP's get_state_dict / set_state_dict on the wrapped optimizer, then bit-exact continuation.
    msd, osd = dsd.get_state_dict(model, opt)
    ref_msd, ref_osd = dsd.get_state_dict(ref, ref_opt)
    assert sorted(osd["state"]) == sorted(ref_osd["state"])
    out["state_diff"] = max(
        (osd["state"][k][n].full_tensor() - ref_osd["state"][k][n].full_tensor()).abs().max().item()
        for k in osd["state"] for n in ("exp_avg", "exp_avg_sq")
    )  # fmt: skip
    _dcp_in_place_round_trip(model, osd, mesh, tmp, out)
    msd = {k: v.detach().clone() for k, v in msd.items()}
    osd = {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in osd["state"].items()},
           "param_groups": osd["param_groups"]}  # fmt: skip
    resumed = _shard(_model(seed=7), mesh)
    resumed_opt = HybridDeviceOptimizer(resumed.parameters(), 1.0, lr=0.5, weight_decay=0.1)
    # set_state_dict loads the optimizer first (after a zero-grad lr=0 step), then the weights;
    # the first step must pick the loaded weights up without an explicit reload_model_params().
    dsd.set_state_dict(resumed, resumed_opt, model_state_dict=msd, optim_state_dict=osd)
    assert resumed_opt.param_groups[0]["lr"] == LR
    _train(model, opt, 2, rank, start=2)
    _train(resumed, resumed_opt, 2, rank, start=2)
    dcp_model, dcp_opt = out["dcp_model"]
    _train(dcp_model, dcp_opt, 2, rank, start=2)
    out["dcp_model"] = dcp_model
    out["resume_exact"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), resumed.parameters())
    )

    out["dcp_resume_exact"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), out.pop("dcp_model").parameters())
    )
    # Accumulation over 3 micro-batches: each reduce-scatter runs the hooks again on the
    # sharded grad FSDP2 accumulates in place; step() must use the final sum.
    acc_ref = _shard(_model(), mesh)
    acc = _shard(_model(), mesh)
    _train(acc_ref, torch.optim.AdamW(acc_ref.parameters(), lr=LR, weight_decay=0.1), 2, rank, micro_batches=3)
    _train(
        acc,
        HybridDeviceOptimizer(torch.optim.AdamW(acc.parameters(), lr=LR, weight_decay=0.1), 1.0),
        2,
        rank,
        micro_batches=3,
    )
    out["accumulation_diff"] = _max_diff(acc.parameters(), acc_ref.parameters())
    if rank == 0 and len(mesh_shape) == 1 and world_size == 2:
        from torch.distributed.tensor import Partial

        bad = torch.nn.Parameter(DTensor.from_local(torch.zeros(3), mesh, [Partial()]))
        try:
            HybridDeviceOptimizer([("partial.w", bad)], 1.0, lr=0.1)
        except ValueError as exc:
            out["partial_error"] = str(exc)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, mesh_shapes", [(2, [(2,)]), (3, [(3,)]), (4, [(4,), (2, 2)])], ids=["2", "3", "4+hsdp2x2"]
)
def test_fsdp2_matches_plain_adamw_on_the_same_sharded_model_and_resumes_through_dcp(world_size, mesh_shapes, tmp_path):
    results = run_ranks(_fsdp_body, world_size, args=(mesh_shapes, str(tmp_path)))
    for case, mesh_shape in enumerate(mesh_shapes):
        for rank, per_rank in enumerate(results):
            r = per_rank[case]
            for fraction in (0.5, 1.0):
                assert r[f"param_diff_{fraction}"] < 1e-5, (mesh_shape, rank, fraction, r)
            assert r["state_diff"] < 1e-6, (mesh_shape, rank, r)
            assert r["resume_exact"], (mesh_shape, rank)
            assert r["staged_in_backward"], (mesh_shape, rank)
            assert r["accumulation_diff"] < 1e-5, (mesh_shape, rank, r["accumulation_diff"])
            assert r["dcp_resume_exact"] and r["dcp_loaded_in_place"], (mesh_shape, rank)
        if world_size > 2 and len(mesh_shape) == 1:
            assert any(r[case]["empty_local_shards"] for r in results), "the model must produce an empty local shard"
    if world_size == 2:
        error = results[0][0]["partial_error"]
        assert "Partial placement" in error and "partial.w" in error


def _flat_shards(
    full: list[torch.Tensor], world_size: int, rank: int, described_by: str = "shard_spec"
) -> list[torch.Tensor]:
    """Rank ``rank``'s contiguous range of each flattened tensor (flat-buffer FSDP layout), as params.

    ``described_by``: ``"shard_spec"`` (this project's ``fsdp_shard_spec``) or
    ``"megatron_fsdp_slice"`` (Megatron-FSDP's slice of the flattened parameter, with
    ``orig_param`` giving the global shape).
    """
    shards = []
    for t in full:
        flat = t.detach().reshape(-1)
        per = -(-flat.numel() // world_size)
        start = min(rank * per, flat.numel())
        stop = min(start + per, flat.numel())
        p = flat[start:stop].clone().requires_grad_()
        if described_by == "shard_spec":
            attach_shard_spec(p, ShardSpec(tuple(t.shape), flat_start=start))
        else:
            p.megatron_fsdp_slice = slice(start, stop)
            p.orig_param = torch.empty(t.shape, device="meta")
        shards.append(p)
    return shards


@pytest.mark.parametrize(
    "described_by, world_size",
    [("shard_spec", 3), ("shard_spec", 4), ("megatron_fsdp_slice", 2), ("megatron_fsdp_slice", 4)],
)
def test_flat_shard_params_match_a_single_process_reference(described_by, world_size):
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen).requires_grad_() for s in [(5, 3), (2,), (3, 3)]]
    ref_opt = torch.optim.AdamW(full, lr=LR, weight_decay=0.1)
    ranks = [_flat_shards(full, world_size, r, described_by) for r in range(world_size)]
    for shards in ranks:  # what the optimizer and the checkpoint layer read: the global place of each shard
        for t, shard in zip(full, shards):
            spec = shard_spec_of(shard)
            assert spec.global_shape == tuple(t.shape) and spec.is_flat
    opts = [HybridDeviceOptimizer(shards, 0.5, lr=LR, weight_decay=0.1) for shards in ranks]
    for _step in range(4):
        grads = [torch.randn(t.shape, generator=gen) for t in full]
        for t, g in zip(full, grads):
            t.grad = g
        for r, shards in enumerate(ranks):
            for s, g in zip(shards, _flat_shards(grads, world_size, r)):
                s.grad = g.detach()
            opts[r].step()
        ref_opt.step()
    for i, t in enumerate(full):
        joined = torch.cat([ranks[r][i].detach() for r in range(world_size)])
        torch.testing.assert_close(joined, t.detach().reshape(-1), rtol=1e-5, atol=1e-6)
    if world_size > 2:
        assert any(s.numel() == 0 for shards in ranks for s in shards), "a rank must hold an empty flat shard"
    for r in range(world_size):
        sd = opts[r].state_dict()
        for pid, shard in enumerate(ranks[r]):
            state = sd["state"][pid]
            assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].shape == shard.shape
            exp_avg = ref_opt.state[full[pid]]["exp_avg"].reshape(-1)
            start = shard_spec_of(shard).flat_start
            torch.testing.assert_close(state["exp_avg"], exp_avg[start : start + shard.numel()], rtol=1e-5, atol=1e-7)
