"""Gradient clipping in the overlapped mode (``speculative_clipping``, offload_fsdp/speculative.py).

The loop users write: ``loss.backward(); optim.clip_grad_norm_(params, max_norm); opt.step()``.
Host buckets update during backward as if no clip applies; ``step()`` commits the ones whose
grads the clip left alone (coefficient 1) and redoes the others. Each step's params are compared
bit for bit with torch's own ``clip_grad_norm_`` followed by the same optimizer without offload:
torch's class itself for fp32 params (fused, the host kernels' arithmetic), and for bf16 params (fp32 masters,
which torch's class does not keep) the default after-backward mode, itself compared with torch
in tests/test_offload_parity.py. What happened is read from ``optimizer.speculation_counts``.
"""

from __future__ import annotations

import pytest
import torch

import optim
from offload_fsdp import HybridDeviceOptimizer
from tests.distributed import run_ranks

WIDTH = 8
CONFIGS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01)),  # no host kernel: one RMSprop per bucket
}
STEPS = 4
# max_norm per step: the clip never fires, always fires, or fires on some steps only
MAX_NORMS = {"never": [1e9] * STEPS, "always": [1e-3] * STEPS, "sometimes": [1e9, 1e-3, 1e9, 1e-3]}


def _net(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH, dtype=dtype) for _ in range(5)]
    return torch.nn.Sequential(*(m for layer in layers for m in (layer, torch.nn.Tanh())))


def _batch(step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step)).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return torch.equal(a.detach().view(ints[a.dtype]), b.detach().view(ints[b.dtype]))


def _step(model, opt, step, max_norm, clip, dtype) -> None:
    model(_batch(step, dtype)).float().square().mean().backward()
    clip(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad()


def _speculating(model, name, fraction=1.0, **kw) -> HybridDeviceOptimizer:
    cls, hyper = CONFIGS[name]
    return HybridDeviceOptimizer(model.named_parameters(), fraction, cpu_optimizer_cls=cls, bucket_numel=80,
                                 overlap_step_with_backward=True, speculative_clipping=True, **hyper, **kw)  # fmt: skip


def _reference(model, name, dtype, fraction=1.0) -> torch.optim.Optimizer:
    cls, hyper = CONFIGS[name]
    if (
        dtype == torch.float32 and fraction == 1.0
    ):  # fused: the host kernels' arithmetic (RMSprop has none, and no fused form)
        return cls(model.parameters(), **({"fused": True} if name != "rmsprop" else {}), **hyper)
    return HybridDeviceOptimizer(model.parameters(), fraction, cpu_optimizer_cls=cls, bucket_numel=80, **hyper)


def _compare(name, dtype, max_norms, clip=optim.clip_grad_norm_, **kw) -> HybridDeviceOptimizer:
    """``clip`` on ours; on the reference the same, with torch's ``clip_grad_norm_`` for optim's."""
    ours, ref = _net(dtype), _net(dtype)
    opt, ref_opt = _speculating(ours, name, **kw), _reference(ref, name, dtype, kw.get("fraction", 1.0))
    ref_clip = getattr(clip, "with_torchs_clip", torch.nn.utils.clip_grad_norm_)
    for step, max_norm in enumerate(max_norms):
        _step(ours, opt, step, max_norm, clip, dtype)
        _step(ref, ref_opt, step, max_norm, ref_clip, dtype)
        for (pname, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert _same_bits(p, q), f"step {step}: {pname} differs from the clip + optimizer without offload"
    return opt


@pytest.mark.parametrize("fires", sorted(MAX_NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_clipping_in_the_overlapped_mode_is_bit_identical_to_clip_then_step_without_offload(name, dtype, fires):
    counts = _compare(name, dtype, MAX_NORMS[fires]).speculation_counts
    buckets_per_step = (counts.committed + counts.redone) // STEPS
    assert buckets_per_step > 1 and counts.deferred == 0  # several buckets, each updated during backward
    fired = sum(m < 1 for m in MAX_NORMS[fires])
    assert counts.redone == fired * buckets_per_step
    assert counts.committed == (STEPS - fired) * buckets_per_step


def test_torchs_own_clip_grad_norm_is_honoured_by_redoing_every_bucket():
    counts = _compare("adamw", torch.float32, MAX_NORMS["sometimes"], clip=torch.nn.utils.clip_grad_norm_)
    counts = counts.speculation_counts
    # torch's clip rescales (by 1 too) without telling the optimizer: every started bucket is redone
    assert counts.committed == 0 and counts.redone > 0


def test_a_snapshot_budget_short_of_the_whole_step_leaves_the_rest_to_step_counted_and_exact():
    probe = _speculating(_net(torch.float32), "adamw")
    per_bucket = 80 * 4 * 3 + 4 * 2  # fp32 master + exp_avg + exp_avg_sq, and two params' `step` scalars at most
    assert probe.speculation_counts.deferred == 0
    counts = _compare("adamw", torch.float32, MAX_NORMS["sometimes"], clip_snapshot_bytes=per_bucket)
    counts = counts.speculation_counts
    assert counts.deferred > 0 and counts.fallback_steps == STEPS and counts.committed + counts.redone > 0
    counts = _compare("adamw", torch.float32, MAX_NORMS["sometimes"], clip_snapshot_bytes=0).speculation_counts
    assert counts.committed == counts.redone == 0 and counts.fallback_steps == STEPS  # all after backward


def test_buckets_without_a_host_kernel_wait_for_step_counted_and_exact():
    counts = _compare("rmsprop", torch.float32, MAX_NORMS["sometimes"]).speculation_counts
    assert counts.committed == counts.redone == 0 and counts.deferred > 0 and counts.fallback_steps == STEPS


def test_a_device_share_and_bound_host_cores_change_nothing_in_the_bits():
    # against the default mode with the same split (its device share runs torch's AdamW, not the fused kernel)
    counts = _compare("adamw", torch.float32, MAX_NORMS["sometimes"], fraction=0.5, bind_host_cores=True)
    counts = counts.speculation_counts
    assert counts.committed > 0 and counts.redone > 0


def _before_clip(edit):
    """A clip that runs ``edit`` on the params first: optim's, and torch's for the reference (``_compare``)."""

    def clip(params, max_norm, clip_grad_norm_=optim.clip_grad_norm_):
        params = list(params)
        edit(params)
        return clip_grad_norm_(params, max_norm)

    clip.with_torchs_clip = lambda params, max_norm: clip(params, max_norm, torch.nn.utils.clip_grad_norm_)
    return clip


def test_a_non_finite_norm_redoes_the_step_with_the_nan_grads_as_torch_would():
    def inf_grad(params):
        params[0].grad[0, 0] = float("inf")  # an inf grad: the norm is inf, the coefficient 0, inf * 0 = NaN

    clip_to_nan = _before_clip(inf_grad)
    ours = _compare("adamw", torch.float32, [1e9, 1.0], clip=clip_to_nan)
    assert ours.speculation_counts.redone > 0 and ours.speculation_counts.committed == 0


def test_a_grad_edited_before_a_clip_that_does_not_fire_is_redone_not_committed():
    def halve(params):
        params[0].grad.mul_(0.5)  # an edit the clip's coefficient of 1 does not account for

    halve_then_clip = _before_clip(halve)
    counts = _compare("adamw", torch.float32, MAX_NORMS["never"], clip=halve_then_clip).speculation_counts
    assert counts.redone == STEPS  # the bucket holding params[0], every step; the others commit
    assert counts.committed > 0


def _scaler_run(overlapped: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, HybridDeviceOptimizer]:
    model = _net(dtype)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, bucket_numel=80, overlap_step_with_backward=overlapped,
                                speculative_clipping=overlapped, **CONFIGS["adamw"][1])  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    for step, max_norm in enumerate([1e9, 1e-3, 1e9, 1e9, 1e-3]):
        loss = model(_batch(step, dtype)).float().square().mean()
        if step in (1, 3):
            loss = loss * float("inf")  # inf grads: GradScaler skips the step and lowers the scale
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        # the reference (after backward) clips with torch's own clip_grad_norm_
        (optim.clip_grad_norm_ if overlapped else torch.nn.utils.clip_grad_norm_)(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_grad_scaler_with_inf_steps_gives_the_default_modes_bits(dtype):
    (ours, opt), (ref, _) = _scaler_run(True, dtype), _scaler_run(False, dtype)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert _same_bits(p, q)
    counts = opt.speculation_counts
    assert counts.committed == 0 and counts.redone > 0  # updates on scaled grads are never kept


def test_without_speculative_clipping_the_clip_is_refused_naming_the_option():
    model = _net(torch.float32)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, bucket_numel=80, overlap_step_with_backward=True, lr=0.1)
    model(_batch(0, torch.float32)).square().mean().backward()
    with pytest.raises(ValueError, match="speculative_clipping=True"):
        optim.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    assert opt.speculation_counts is None
    with pytest.raises(ValueError, match="overlap_step_with_backward=True only"):
        HybridDeviceOptimizer(model.parameters(), 1.0, speculative_clipping=True, lr=0.1)
    with pytest.raises(ValueError, match="clip_snapshot_bytes"):
        HybridDeviceOptimizer(model.parameters(), 1.0, overlap_step_with_backward=True, speculative_clipping=True,
                              clip_snapshot_bytes=-1, lr=0.1)  # fmt: skip


def _fsdp_body(rank: int, world_size: int, name: str, dtype_name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (world_size,))
    models = []
    for _ in range(2):
        model = _net(dtype)
        for i in range(0, len(model), 2):
            fully_shard(model[i], mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    ours, ref = models
    cls, hyper = CONFIGS[name]
    opt = _speculating(ours, name)
    ref_opt = HybridDeviceOptimizer(ref.parameters(), 1.0, cpu_optimizer_cls=cls, bucket_numel=80, **hyper)
    for step, max_norm in enumerate(MAX_NORMS["sometimes"]):
        # the reference: torch's own clip_grad_norm_ on the DTensor params, then the default mode
        for model, o, clip in ((ours, opt, optim.clip_grad_norm_), (ref, ref_opt, torch.nn.utils.clip_grad_norm_)):
            model(_batch(step * world_size + rank, dtype)).float().square().mean().backward()
            clip(model.parameters(), max_norm)
            o.step()
            o.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert _same_bits(p.to_local(), q.to_local()), f"rank {rank} step {step}"
    counts = opt.speculation_counts
    return {"committed": counts.committed, "redone": counts.redone}


@pytest.mark.parametrize(("name", "dtype"), [("adamw", "bfloat16"), ("sgd", "float32")])
def test_fsdp2_on_two_ranks_commits_and_redoes_bit_identically_to_the_default_mode(name, dtype):
    for counts in run_ranks(_fsdp_body, world_size=2, args=(name, dtype), timeout_s=120):
        assert counts["committed"] > 0 and counts["redone"] > 0
