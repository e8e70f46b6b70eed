"""An adversarial review of ``pinned_transfer_slots``: random training sequences, ring vs full pinning.

The ring engine runs over the emulated device of ``tests/fakes/deferred_queues.py``
(copies complete only when waited on, in-flight destinations read as NaN, an
in-flight source that changes raises), so a missing wait gives NaN or raises.
Every sequence of backward (with and without ``defer_grad_copies``, on some params
only), ``zero_grad`` (to None or to zeros), in-place grad edits, replaced grads,
``step``, ``state_dict`` and ``load_state_dict`` must leave params and state
bit-identical to the default mode, with the ring never past its slots and
nothing held across steps.
"""

from __future__ import annotations

import contextlib
import gc
import io
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_offload_transfer_ring import _build, _loss, _params, _ring_engines, _state_bits

_OPS = ("backward", "backward_deferred", "backward_some", "zero_grad", "zero_grad_to_zeros", "scale_grads",
        "replace_grads", "step", "state_dict", "load_state_dict")  # fmt: skip


def _run_ops(opt, params, ops, dtype):
    """Apply ``ops`` (name, seed) to ``opt`` / ``params``; one last step at the end."""
    saved = None
    for op, seed in ops:
        gen = torch.Generator().manual_seed(seed)
        if op.startswith("backward"):
            x = torch.randn(4, 13, generator=gen).to(dtype)
            ctx = opt.defer_grad_copies() if op == "backward_deferred" else contextlib.nullcontext()
            with ctx:
                loss = _loss(params, x)
                if op == "backward_some":  # only the params picked by the seed's bits get a grad
                    picked = [p for i, p in enumerate(params) if (seed >> i) & 1]
                    loss = sum((p.float().square().sum() * 1e-2 for p in picked), torch.zeros(()))
                if loss.requires_grad:
                    loss.backward()
        elif op == "zero_grad":
            opt.zero_grad()
        elif op == "zero_grad_to_zeros":
            opt.zero_grad(set_to_none=False)
        elif op == "scale_grads":  # an in-place edit after backward (unscaling, clipping)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1 + (seed % 7) / 10)
        elif op == "replace_grads":
            for p in params:
                if p.grad is not None:
                    p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        elif op == "step":
            opt.step()
        elif op == "state_dict":
            saved = io.BytesIO()
            torch.save(opt.state_dict(), saved)
        elif op == "load_state_dict" and saved is not None:
            saved.seek(0)
            opt.load_state_dict(torch.load(saved, weights_only=True))
    opt.step()


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 1000)), min_size=1, max_size=12),
    slots=st.integers(1, 3),
    cls=st.sampled_from([torch.optim.AdamW, torch.optim.SGD]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    fraction=st.sampled_from([1.0, 0.5]),
)
def test_any_sequence_of_backward_zero_grad_grad_edits_steps_and_state_dict_round_trips_is_bit_identical(
    ops, slots, cls, dtype, fraction
):
    ref_params = _params(dtype)
    ref = _build(ref_params, cls, fraction, None)
    _run_ops(ref, ref_params, ops, dtype)

    params = _params(dtype)
    with pytest_monkeypatch() as m:
        engines = _ring_engines(m, slots)
        opt = _build(params, cls, fraction, slots)
    _run_ops(opt, params, ops, dtype)

    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    for ours, theirs in zip(_state_bits(opt), _state_bits(ref)):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    (engine,) = engines
    assert engine.d2h_ring.peak_in_use <= slots and engine.h2d_ring.peak_in_use <= slots
    assert engine.d2h_ring.in_use == 0 and engine.queues.d2h_lane.pending == []  # nothing held after a step


@contextlib.contextmanager
def pytest_monkeypatch():
    """``monkeypatch.context()`` for a hypothesis test (function-scoped fixtures do not reset per example)."""
    import pytest

    with pytest.MonkeyPatch.context() as m:
        yield m


def test_zero_grad_between_backward_and_step_frees_the_held_slots_and_the_dropped_device_grads(monkeypatch):
    params = _params(torch.bfloat16)
    with monkeypatch.context() as m:
        engines = _ring_engines(m, 2)
        opt = _build(params, torch.optim.AdamW, 1.0, 2)
    (engine,) = engines
    _loss(params, torch.randn(4, 13).bfloat16()).backward()
    assert len(opt.layout().buckets) > 2 and engine.d2h_ring.in_use == 2  # the hooks' copies hold both slots
    dropped = [weakref.ref(p.grad) for p in params]
    opt.zero_grad()
    gc.collect()
    assert engine.d2h_ring.in_use == 0 and engine.queues.d2h_lane.pending == []
    assert all(g() is None for g in dropped)  # no slot keeps a grad the user dropped alive


# ------------------------------------------------------------------ FSDP2 over gloo: tied weights, clipping, SGD


def _tied_fsdp_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from offload_fsdp import HybridDeviceOptimizer
    from optim.clip import clip_grad_norm_  # torch's on DTensor grads: see the xfail tests below

    mesh = init_device_mesh("cpu", (world_size,))
    final, peaks = {}, []
    for slots in (None, 1):
        torch.manual_seed(0)
        # 5 rows: uneven shards at 2 ranks; the last layer reuses the first one's weight (its
        # grad is final only once backward has passed both uses).
        model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Tanh(),
                                    torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5))  # fmt: skip
        model[6].weight = model[0].weight
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        engines = []
        with pytest.MonkeyPatch.context() as m:
            if slots is not None:  # the emulated device, in this rank's process
                engines = _ring_engines(m, slots)
            opt = HybridDeviceOptimizer(
                model.parameters(), 1.0, cpu_optimizer_cls=torch.optim.SGD, lr=0.05, momentum=0.9,
                bucket_numel=8, pinned_transfer_slots=slots,
            )  # fmt: skip
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + rank)
            for _ in range(2):  # gradient accumulation
                model(torch.randn(4, 5, generator=gen)).square().mean().backward()
            clip_grad_norm_(model.parameters(), 0.05)  # grads edited after the hooks copied them
            opt.step()
            sched.step()
            opt.zero_grad()
        final[slots] = [p.to_local().clone() for p in model.parameters()]
        peaks += [e.d2h_ring.peak_in_use for e in engines]
    return {"equal": all(torch.equal(a, b) for a, b in zip(final[None], final[1])), "peaks": peaks}


def test_fsdp2_tied_weights_clipping_and_sgd_momentum_through_a_one_slot_ring_match_full_pinning_at_2_ranks():
    from tests.distributed import run_ranks

    for result in run_ranks(_tied_fsdp_body, 2):
        assert result == {"equal": True, "peaks": [1]}


# ------------------------------------------------------------------ grads edited after backward under FSDP2 (any mode)


def _edited_fsdp_grads_body(rank: int, world_size: int, edits: tuple[str, ...]) -> dict:
    """Max |difference| of the local params after 2 steps, HybridDeviceOptimizer (default mode)
    vs torch's SGD, per way of editing the DTensor grads after backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from offload_fsdp import HybridDeviceOptimizer
    from optim.clip import clip_grad_norm_

    mesh = init_device_mesh("cpu", (world_size,))
    edit_fns = {
        "none": lambda ps: None,
        "optim.clip.clip_grad_norm_": lambda ps: clip_grad_norm_(ps, 0.01),
        "torch clip_grad_norm_": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.01),
        "grad.mul_": lambda ps: [p.grad.mul_(0.01) for p in ps],
    }
    out = {}
    for edit in edits:
        finals = []
        for offload in (False, True):
            torch.manual_seed(0)
            model = fully_shard(
                torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5)), mesh=mesh
            )
            params = list(model.parameters())
            opt = (HybridDeviceOptimizer(params, 1.0, cpu_optimizer_cls=torch.optim.SGD, lr=0.05) if offload
                   else torch.optim.SGD(params, lr=0.05))  # fmt: skip
            for step in range(2):
                gen = torch.Generator().manual_seed(step + rank)
                model(torch.randn(4, 5, generator=gen)).square().mean().backward()  # hooks copy the grads
                edit_fns[edit](params)
                opt.step()
                opt.zero_grad()
            finals.append([p.to_local().clone() for p in params])
        out[edit] = max((a - b).abs().max().item() for a, b in zip(*finals) if a.numel())
    return out


def test_fsdp2_grads_clipped_with_optim_clip_after_the_hooks_copied_them_are_recopied_by_step():
    from tests.distributed import run_ranks

    edits = ("none", "optim.clip.clip_grad_norm_")
    for result in run_ranks(_edited_fsdp_grads_body, 2, (edits,)):
        assert result == dict.fromkeys(edits, 0.0)


def test_fsdp2_grads_edited_in_place_by_torch_clip_or_mul_after_the_hooks_copied_them_are_recopied_by_step():
    from tests.distributed import run_ranks

    edits = ("torch clip_grad_norm_", "grad.mul_")
    for result in run_ranks(_edited_fsdp_grads_body, 2, (edits,)):
        assert result == dict.fromkeys(edits, 0.0)


# ------------------------------------------------------------------ a device copy that raises


class _DeviceError(RuntimeError):
    pass


def _fail_once(queues, direction: str) -> None:
    """Make the ``direction`` ("d2h" / "h2d") copy of ``queues`` raise the first time it is queued."""
    real, calls = getattr(queues, direction), []

    def queue(*args, **kwargs):
        calls.append(None)
        if len(calls) == 1:
            raise _DeviceError(f"{direction} copy failed (injected)")
        return real(*args, **kwargs)

    setattr(queues, direction, queue)


def _set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:  # assigned, not from backward: step() stages every grad itself
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def test_a_grad_copy_that_raises_inside_step_surfaces_its_own_error_and_a_retried_step_is_bit_identical(monkeypatch):
    ref_params = _params(torch.bfloat16)
    ref = _build(ref_params, torch.optim.AdamW, 1.0, None)
    params = _params(torch.bfloat16)
    with monkeypatch.context() as m:
        engines = _ring_engines(m, 1)
        opt = _build(params, torch.optim.AdamW, 1.0, 1)
    for step in range(3):
        _set_grads(ref_params, step)
        _set_grads(params, step)
        ref.step()
        if step == 1:
            _fail_once(engines[0].queues, "d2h")
            with pytest.raises(_DeviceError):  # its own error, nothing updated: the D2H runs before any host step
                opt.step()
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert engines[0].d2h_ring.in_use == 0


def test_a_param_copy_that_raises_surfaces_its_own_error_and_leaves_the_ring_usable(monkeypatch):
    params = _params(torch.bfloat16)
    with monkeypatch.context() as m:
        engines = _ring_engines(m, 1)
        opt = _build(params, torch.optim.AdamW, 1.0, 1)
    _fail_once(engines[0].queues, "h2d")
    _set_grads(params, 0)
    with pytest.raises(_DeviceError):
        opt.step()
    _set_grads(params, 1)
    opt.step()  # the slot of the failed copy is reused: nothing was queued from it
    assert engines[0].h2d_ring.peak_in_use == 1 and not any(p.isnan().any() for p in params)


def test_transposed_sliced_and_stride_0_grads_cross_the_ring_bit_identically(monkeypatch):
    def grads_of(params, step):
        gen = torch.Generator().manual_seed(step)
        out = []
        for i, p in enumerate(params):
            if i % 3 == 0 and p.dim() == 2:  # transposed
                out.append(torch.randn(p.shape[::-1], generator=gen).to(p.dtype).t())
            elif i % 3 == 1:  # every other element of a longer buffer
                out.append(torch.randn(2 * p.numel(), generator=gen).to(p.dtype)[::2].view(p.shape))
            else:  # stride 0: one value broadcast
                out.append(torch.randn(1, generator=gen).to(p.dtype).expand(p.shape))
        return out

    def run(slots):
        params = _params(torch.bfloat16)
        opt = _build(params, torch.optim.AdamW, 1.0, slots)
        for step in range(3):
            for p, g in zip(params, grads_of(params, step)):
                p.grad = g
            opt.step()
            opt.zero_grad()
        return params

    ref = run(None)
    with monkeypatch.context() as m:
        _ring_engines(m, 1)
        ours = run(1)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


# ------------------------------------------------------------------ GradScaler (any mode, single process)


def _params_after_grad_scaler_steps(offload: bool, enabled: bool) -> list[torch.Tensor]:
    from offload_fsdp import HybridDeviceOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh(), torch.nn.Linear(5, 5))
    params = list(model.parameters())
    opt = (HybridDeviceOptimizer(params, 1.0, cpu_optimizer_cls=torch.optim.SGD, lr=0.05) if offload
           else torch.optim.SGD(params, lr=0.05))  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=enabled)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        scaler.scale(model(torch.randn(4, 5, generator=gen)).square().mean()).backward()  # hooks copy the grads
        scaler.unscale_(opt)  # in place, after the hooks' copies
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in params]


def test_without_loss_scaling_a_grad_scaler_loop_matches_torch_sgd_bit_for_bit():
    ours, theirs = (_params_after_grad_scaler_steps(offload, enabled=False) for offload in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_grads_unscaled_by_a_grad_scaler_after_the_hooks_copied_them_are_recopied_by_step():
    ours, theirs = (_params_after_grad_scaler_steps(offload, enabled=True) for offload in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
