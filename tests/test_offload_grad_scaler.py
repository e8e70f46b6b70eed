"""torch.amp.GradScaler drives a HybridDeviceOptimizer exactly as it drives the plain torch optimizer.

GradScaler unscales grads with a kernel that bumps no version counter, after the backward
hooks already copied the scaled grads to the host: step() must not use those copies.
"""

from __future__ import annotations

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer


def _train(cls, offload: float, reference: bool, *, explicit_unscale: bool, clip: bool, inf_step: int | None):
    """``reference``: no backward hooks (step() copies every grad) and GradScaler's own unscale-and-skip path."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    params = list(model.parameters())
    opt = HybridDeviceOptimizer(
        params, offload, cpu_optimizer_cls=cls, lr=0.05, overlap_cpu_optimizer_d2h_h2d=not reference
    )
    if reference:
        # torch.amp.GradScaler reads this class flag of its protocol (no public switch): off, GradScaler
        # unscales and skips as for any torch optimizer, the path compared against
        opt._step_supports_amp_scaling = False
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 6, generator=gen)).square().mean()
        if step == inf_step:
            loss = loss * float("inf")  # inf grads: GradScaler skips this step and lowers the scale
        scaler.scale(loss).backward()  # the offloaded params' hooks copy the scaled grads
        if explicit_unscale:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 0.01)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in params], scaler.get_scale()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("offload", [1.0, 0.5])
@pytest.mark.parametrize(
    "explicit_unscale, clip, inf_step",
    [(False, False, None), (True, False, None), (True, True, None), (False, False, 2)],
)
def test_a_grad_scaler_loop_matches_the_plain_torch_optimizer_bit_for_bit(
    cls, offload, explicit_unscale, clip, inf_step
):
    options = dict(explicit_unscale=explicit_unscale, clip=clip, inf_step=inf_step)
    theirs, their_scale = _train(cls, offload, True, **options)
    ours, our_scale = _train(cls, offload, False, **options)
    assert our_scale == their_scale
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_a_grad_scaler_loop_with_sgd_matches_torch_sgd_itself_bit_for_bit():
    torch.manual_seed(0)
    runs = []
    for offload in (None, 1.0):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        params = list(model.parameters())
        opt = (torch.optim.SGD(params, lr=0.05) if offload is None
               else HybridDeviceOptimizer(params, offload, cpu_optimizer_cls=torch.optim.SGD, lr=0.05))  # fmt: skip
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            scaler.scale(model(torch.randn(4, 6, generator=gen)).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
