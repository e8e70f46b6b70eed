"""Grad writes autograd's version counter does not see, after backward and before ``step()``.

``p.grad.data.mul_(...)``, ``p.grad.data.zero_()`` and a manual ``dist.all_reduce(p.grad)``
(data parallelism written by hand) change a plain param's grad without moving its version
counter, after the backward hooks copied it to the host. Every mode must use the grads as they
are at ``step()``: the default mode and ``speculative_clipping`` give the bits of torch's fused
AdamW on the same edited grads, the overlapped mode without it refuses the step naming the
param. Nothing here reads the optimizer's internals: params, exceptions and
``optimizer.speculation_counts``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from offload_fsdp import HybridDeviceOptimizer
from tests.distributed import run_ranks

HYPER = dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
MODES = {
    "default": {},
    "overlapped": {"overlap_step_with_backward": True},
    "speculative": {"overlap_step_with_backward": True, "speculative_clipping": True},
}
STEPS = 3


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3))  # fmt: skip


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, edit: Callable[[torch.Tensor], None], seed: int) -> None:
    for step in range(STEPS):
        model(_batch(seed * 100 + step)).square().mean().backward()
        for p in model.parameters():
            edit(p.grad)
        opt.step()
        opt.zero_grad()


def _ours(model: torch.nn.Module, mode: str) -> HybridDeviceOptimizer:
    # one param per bucket (the biggest is 36 elements): several buckets start during backward
    return HybridDeviceOptimizer(model.named_parameters(), 1.0, bucket_numel=40, **MODES[mode], **HYPER)


def _halve(grad: torch.Tensor) -> None:
    grad.data.mul_(0.5)


def _zero(grad: torch.Tensor) -> None:
    grad.data.zero_()


def _scale_first_row(grad: torch.Tensor) -> None:
    grad.data[0].mul_(-3.0)  # part of the tensor, through a view of .data


EDITS = {"data.mul_": _halve, "data.zero_": _zero, "data[0].mul_": _scale_first_row}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("mode", ["default", "speculative"])
def test_a_grad_written_below_the_version_counter_is_used_as_it_is_at_step(mode, edit):
    ours, ref = _net(), _net()
    opt, ref_opt = _ours(ours, mode), torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    _train(ours, opt, EDITS[edit], seed=1)
    _train(ref, ref_opt, EDITS[edit], seed=1)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert _same_bits(p, q), f"{name} differs from torch's AdamW on the edited grads"
    if mode == "speculative":
        counts = opt.speculation_counts
        # every bucket started during backward (several per step) and was redone, none committed
        assert counts.committed == counts.deferred == 0 and counts.redone % STEPS == 0 and counts.redone > STEPS


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_the_overlapped_mode_refuses_a_grad_written_below_the_version_counter_naming_the_param(edit):
    model = _net()
    opt = _ours(model, "overlapped")
    model(_batch(0)).square().mean().backward()
    EDITS[edit](model[4].weight.grad)
    with pytest.raises(
        ValueError, match="gradient of parameter '4.weight' was changed in place .*speculative_clipping"
    ):
        opt.step()


def test_an_unedited_step_still_commits_every_bucket_updated_during_backward():
    ours, ref = _net(), _net()
    opt, ref_opt = _ours(ours, "speculative"), torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    _train(ours, opt, lambda grad: None, seed=2)
    _train(ref, ref_opt, lambda grad: None, seed=2)
    assert all(_same_bits(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    counts = opt.speculation_counts
    assert counts.redone == counts.deferred == 0 and counts.committed % STEPS == 0 and counts.committed > STEPS


def _all_reduce(grad: torch.Tensor) -> None:
    dist.all_reduce(grad)  # in place through c10d: no version counter moves


def _manual_dp_body(rank: int, world_size: int, mode: str) -> dict:
    ours, ref = _net(), _net()
    opt = _ours(ours, mode)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    _train(ref, ref_opt, _all_reduce, seed=rank)
    try:
        _train(ours, opt, _all_reduce, seed=rank)
    except ValueError as exc:
        return {"refused": str(exc)}
    same = [_same_bits(p, q) for p, q in zip(ours.parameters(), ref.parameters())]
    return {"same": all(same), "replicas_agree": _replicas_agree(ours)}


def _replicas_agree(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


@pytest.mark.parametrize("mode", ["default", "speculative", "overlapped"])
def test_manual_data_parallel_all_reduce_after_backward_is_honoured_or_refused_on_two_ranks(mode):
    results = run_ranks(_manual_dp_body, world_size=2, args=(mode,), timeout_s=120)
    if mode == "overlapped":
        assert all("dist.all_reduce(p.grad)" in r.get("refused", "") for r in results), results
    else:
        assert all(r == {"same": True, "replicas_agree": True} for r in results), results
