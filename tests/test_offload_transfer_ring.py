"""Bounded pinned memory (``pinned_transfer_slots``): the ring engine against an emulated async device.

On a CPU the ring engine runs over ``tests/fakes/deferred_queues.py``: copies
complete only when waited on, an in-flight destination reads as NaN and an
in-flight source must not change. So a slot drained before its D2H landed, or
overwritten while its H2D still reads it, gives NaN or raises, never a lucky
match. Results are compared bit for bit with the default mode. The accelerator
tests at the end check the real pinned bytes and results on a device.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_fsdp import HybridDeviceOptimizer, transfer
from offload_fsdp.transfer_ring import RingCopyEngine
from tests.fakes.deferred_queues import DeferredEvent, DeferredQueues, SlotOverwritten

# ------------------------------------------------------------------ the engine alone


def _bucket(numel: int, dtype: torch.dtype = torch.float32) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        numel=numel, grad_dtype=dtype, param_dtype=dtype, grad_stage=torch.zeros(numel, dtype=dtype), h2d_done=None
    )


def _engine(buckets, slots: int) -> RingCopyEngine:
    engine = RingCopyEngine(torch.device("cpu"), slots, queues=DeferredQueues(), pin=False)
    engine.fit(buckets)
    return engine


def _grads_by_param(buckets, sizes, seed=0):
    """Per bucket, (staging view, grad) per param: the bucket's grad staging cut into ``sizes``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b in buckets:
        views, start = [], 0
        for n in sizes:
            views.append((b.grad_stage[start : start + n], torch.randn(n, generator=gen, dtype=b.grad_dtype)))
            start += n
        out.append(views)
    return out


def test_backward_hooks_hold_at_most_the_ring_drain_the_oldest_and_every_grad_lands_in_its_staging():
    sizes = (5, 1, 7)
    buckets = [_bucket(sum(sizes)) for _ in range(5)]
    engine = _engine(buckets, slots=2)
    grads = _grads_by_param(buckets, sizes)
    # backward (no begin_step yet): grads arrive param by param, buckets in reverse, one of bucket 4 late
    for b in reversed(range(5)):
        for view, g in grads[b][: 2 if b == 4 else 3]:
            engine.stage_grad(buckets[b], view, g)
            assert engine.d2h_ring.in_use <= 2
    # the copies of buckets 4, 3 and 2 (2 + 3 + 3 grads) ran: they were drained to make room for 2, 1 and 0
    assert engine.queues.d2h_lane.ran == 2 + 3 + 3 and engine.d2h_ring.in_use == 2
    engine.stage_grad(buckets[4], *grads[4][2])  # bucket 4 was drained for bucket 2: it takes a slot again
    engine.begin_step()
    for b in range(5):
        engine.wait_grads(buckets[b])
        torch.testing.assert_close(buckets[b].grad_stage, torch.cat([g for _, g in grads[b]]), rtol=0, atol=0)
    engine.end_step()
    assert engine.d2h_ring.peak_in_use == 2 and engine.d2h_ring.in_use == 0


@settings(max_examples=60, deadline=None)
@given(
    in_step=st.booleans(),
    slots=st.integers(1, 3),
    layout=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), min_size=1, max_size=5),
    data=st.data(),
)
def test_any_order_of_staged_grads_and_drains_lands_each_params_last_grad_within_the_slot_bound(
    in_step, slots, layout, data
):
    buckets = [_bucket(sum(sizes)) for sizes in layout]
    engine = _engine(buckets, slots)
    params = [
        (b, start, n) for b, sizes in enumerate(layout) for start, n in zip(itertools.accumulate([0, *sizes]), sizes)
    ]
    expected = [torch.zeros(b.numel) for b in buckets]
    if in_step:  # grads staged by step() wait for a slot; else (backward hooks) the oldest is drained
        engine.begin_step()
    for step in range(data.draw(st.integers(1, 25), label="events")):
        if data.draw(st.booleans(), label="drain?"):
            engine.wait_grads(buckets[data.draw(st.integers(0, len(buckets) - 1), label="drained bucket")])
        else:
            b, start, n = data.draw(st.sampled_from(params), label="staged param")
            grad = torch.full((n,), float(step + 1))
            engine.stage_grad(buckets[b], buckets[b].grad_stage[start : start + n], grad)
            expected[b][start : start + n] = grad
        assert engine.d2h_ring.in_use <= slots
    for bucket in buckets:
        engine.wait_grads(bucket)
    assert all(torch.equal(b.grad_stage, e) for b, e in zip(buckets, expected))
    engine.end_step()
    assert engine.d2h_ring.in_use == 0 and engine.d2h_ring.peak_in_use <= slots


def test_inside_step_grads_without_a_slot_wait_and_each_drain_starts_the_next_buckets_copy():
    buckets = [_bucket(4) for _ in range(4)]
    engine = _engine(buckets, slots=2)
    lane = engine.queues.d2h_lane
    grads = [torch.full((4,), float(i + 1)) for i in range(4)]
    engine.begin_step()
    for b, g in zip(buckets, grads):
        engine.stage_grad(b, b.grad_stage, g)
    assert lane.queued == 2 and lane.ran == 0  # staging never blocked: buckets 2 and 3 wait uncopied
    engine.wait_grads(buckets[0])
    assert lane.queued == 3 and lane.ran == 1  # bucket 0 drained; bucket 2's copy now in flight
    engine.wait_grads(buckets[3])  # out of order: it takes a slot (draining bucket 1) and is drained
    assert torch.equal(buckets[3].grad_stage, grads[3]) and torch.equal(buckets[1].grad_stage, grads[1])
    for b, g in zip(buckets, grads):
        engine.wait_grads(b)
        assert torch.equal(b.grad_stage, g)
    engine.end_step()
    assert engine.d2h_ring.peak_in_use == 2 and engine.d2h_ring.in_use == 0


def test_a_regrad_staged_twice_into_a_held_slot_lands_its_last_value():
    buckets = [_bucket(6)]
    engine = _engine(buckets, slots=1)
    view = buckets[0].grad_stage[2:5]
    engine.begin_step()
    engine.stage_grad(buckets[0], view, torch.full((3,), 1.0))
    engine.stage_grad(buckets[0], view, torch.full((3,), 2.0))  # accumulated, copied again
    engine.wait_grads(buckets[0])
    assert buckets[0].grad_stage.tolist() == [0, 0, 2, 2, 2, 0]  # unstaged elements untouched
    engine.end_step()


def test_h2d_slots_are_rewritten_only_after_their_copy_ran_and_params_get_their_values():
    buckets = [_bucket(8, torch.bfloat16) for _ in range(5)]
    engine = _engine(buckets, slots=2)
    params = [(torch.zeros(3, 2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)) for _ in buckets]
    sources = [(torch.randn(3, 2).bfloat16(), torch.randn(2).bfloat16()) for _ in buckets]
    engine.begin_step()
    for b, (dst, src) in enumerate(zip(params, sources)):
        engine.push_params(buckets[b], list(zip(dst, src)))
        assert engine.h2d_ring.in_use <= 2
    assert all(p.isnan().all() for p in params[-1])  # the last copy has not run: its params are undefined
    engine.end_step()  # the main stream waits for the last H2D (the lane runs in order: all of them)
    for dst, src in zip(params, sources):
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
    assert engine.h2d_ring.peak_in_use == 2


def test_a_forward_waits_only_for_its_own_buckets_h2d_when_the_step_leaves_the_main_stream_free():
    buckets = [_bucket(2) for _ in range(3)]
    engine = _engine(buckets, slots=3)
    params = [torch.zeros(2) for _ in buckets]
    engine.begin_step()
    for b, p in zip(buckets, params):
        engine.push_params(b, [(p, torch.full((2,), 7.0))])
    engine.end_step(main_waits=False)  # per-module forward waits (the overlapped step's model=)
    assert all(p.isnan().all() for p in params)
    engine.wait_pushed(buckets[1])  # the lane runs in order: buckets 0 and 1 have landed, 2 has not
    assert params[0].eq(7).all() and params[1].eq(7).all() and params[2].isnan().all()
    engine.wait_pushed(buckets[2])
    assert params[2].eq(7).all()


def test_an_h2d_queued_after_note_params_read_waits_for_the_later_main_stream_mark():
    buckets = [_bucket(2) for _ in range(2)]
    engine = _engine(buckets, slots=2)
    marks = []
    engine.queues.mark_main = lambda: marks.append(DeferredEvent(None, 0)) or marks[-1]
    afters = []
    real_h2d = engine.queues.h2d
    engine.queues.h2d = lambda pairs, after: afters.append(after) or real_h2d(pairs, after)
    engine.begin_step()
    engine.push_params(buckets[0], [(torch.zeros(2), torch.ones(2))])
    engine.note_params_read()
    engine.push_params(buckets[1], [(torch.zeros(2), torch.ones(2))])
    assert afters == marks and len(marks) == 2
    engine.end_step()


class _NoWait(DeferredQueues):
    """A broken device binding: events that return before their copies ran."""

    def d2h(self, dst, src):
        super().d2h(dst, src)
        return DeferredEvent(None, 0)

    def h2d(self, pairs, after):
        super().h2d(pairs, after)
        return DeferredEvent(None, 0)


def test_the_emulated_device_catches_a_slot_read_before_its_d2h_landed():
    buckets = [_bucket(4)]
    engine = RingCopyEngine(torch.device("cpu"), 1, queues=_NoWait(), pin=False)
    engine.fit(buckets)
    engine.begin_step()
    engine.stage_grad(buckets[0], buckets[0].grad_stage, torch.ones(4))
    engine.wait_grads(buckets[0])
    assert buckets[0].grad_stage.isnan().all()


def test_the_emulated_device_catches_a_slot_overwritten_while_its_h2d_reads_it():
    buckets = [_bucket(4), _bucket(4)]
    engine = RingCopyEngine(torch.device("cpu"), 1, queues=_NoWait(), pin=False)
    engine.fit(buckets)
    engine.begin_step()
    engine.push_params(buckets[0], [(torch.zeros(4), torch.ones(4))])
    engine.push_params(buckets[1], [(torch.zeros(4), torch.full((4,), 2.0))])  # reuses the only slot too early
    with pytest.raises(SlotOverwritten):
        engine.queues.h2d_lane.run_until(2)


def test_slots_are_sized_to_the_largest_bucket_per_direction_and_grow_for_a_later_larger_bucket():
    small, large = _bucket(10, torch.bfloat16), _bucket(70, torch.float32)
    engine = _engine([small], slots=3)
    assert engine.slot_bytes == (24, 24)  # 20 bytes, in whole 8-byte words
    assert 3 * 2 * 24 <= engine.reserved_bytes < 3 * 2 * (24 + 64)  # the arena aligns each slot to 64 bytes
    engine.fit([large])
    assert engine.slot_bytes == (280, 280) and 3 * 2 * 280 <= engine.reserved_bytes < 3 * 2 * (280 + 64)
    assert engine.d2h_ring.capacity == engine.h2d_ring.capacity == 3


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_pinned_transfer_slots_other_than_none_or_a_positive_int_is_refused_naming_the_option(value):
    with pytest.raises(ValueError, match="pinned_transfer_slots"):
        HybridDeviceOptimizer([torch.nn.Parameter(torch.ones(3))], lr=0.1, pinned_transfer_slots=value)


# ------------------------------------------------------------------ through the optimizer


def _ring_engines(monkeypatch, slots):
    """Make every optimizer built in this context use a ring engine on the emulated device."""
    engines: list[RingCopyEngine] = []

    def engine_for(device, *, transfer_slots):
        engines.append(RingCopyEngine(device, slots, queues=DeferredQueues(), pin=False))
        return engines[-1]

    monkeypatch.setattr(transfer, "copy_engine_for", engine_for)  # the one place engines are chosen
    return engines


def _made_engines(monkeypatch):
    """Every copy engine made from now on (by the real factory), in order."""
    made: list = []
    real = transfer.copy_engine_for
    monkeypatch.setattr(transfer, "copy_engine_for", lambda device, **kw: made.append(real(device, **kw)) or made[-1])
    return made


SHAPES = [(7, 13), (7,), (9, 7), (9,), (1, 9), (31,), (4, 5)]


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s in SHAPES]


def _loss(params, x):
    w1, b1, w2, b2, w3, extra, w4 = params
    h = torch.tanh(x @ w1.T + b1)
    h = torch.tanh(h @ w2.T + b2)
    out = (h @ w3.T).squeeze(-1)  # (B,)
    return out.float().square().mean() + extra.float().square().sum() * 1e-2 + w4.float().abs().sum() * 1e-3


def _train(opt, params, *, steps=3, micro_batches=2, defer=False, dtype=torch.float32, clip=None):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for i in range(micro_batches):
            x = torch.randn(4, 13, generator=gen).to(dtype)
            ctx = opt.defer_grad_copies() if defer and i < micro_batches - 1 else contextlib.nullcontext()
            with ctx:
                _loss(params, x).backward()
        if clip is not None:  # grads changed after backward: step() copies every one again
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        opt.zero_grad()


def _build(params, cls, fraction, slots):
    kwargs = {"lr": 0.05, "momentum": 0.9} if cls is torch.optim.SGD else {"lr": 0.05, "weight_decay": 0.1}
    return HybridDeviceOptimizer(
        params, fraction, cpu_optimizer_cls=cls, bucket_numel=64, pinned_transfer_slots=slots, **kwargs
    )


def _state_bits(opt):
    return [
        {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        for g in opt.param_groups
        for p in g["params"]
    ]


@pytest.mark.parametrize(("defer", "slots"), [(False, 1), (True, 2)])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_ring_mode_is_bit_identical_to_full_pinning_with_accumulation_and_a_scheduler(
    monkeypatch, cls, dtype, fraction, defer, slots
):
    ref_params = _params(dtype)
    ref = _build(ref_params, cls, fraction, None)
    _train(ref, ref_params, defer=defer, dtype=dtype)

    params = _params(dtype)
    with monkeypatch.context() as m:
        engines = _ring_engines(m, slots)
        opt = _build(params, cls, fraction, slots)
    buckets = opt.layout().buckets
    assert len(buckets) >= 2 and len(engines) == 1 and {b.copy_engine for b in buckets} == {"RingCopyEngine"}
    _train(opt, params, defer=defer, dtype=dtype)

    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    for ours, theirs in zip(_state_bits(opt), _state_bits(ref)):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    engine = engines[0]
    # the ring was exercised to its bound and never past it; nothing is left in flight
    assert engine.d2h_ring.peak_in_use == engine.h2d_ring.peak_in_use == slots
    assert engine.d2h_ring.in_use == 0 and engine.queues.d2h_lane.pending == []


@pytest.mark.parametrize("slots", [1, 2])
def test_grads_clipped_after_backward_are_recopied_inside_step_through_waiting_slots_bit_identically(
    monkeypatch, slots
):
    ref_params = _params(torch.bfloat16)
    ref = _build(ref_params, torch.optim.AdamW, 1.0, None)
    _train(ref, ref_params, dtype=torch.bfloat16, clip=0.1)

    params = _params(torch.bfloat16)
    waited = []
    with monkeypatch.context() as m:
        engines = _ring_engines(m, slots)
        opt = _build(params, torch.optim.AdamW, 1.0, slots)
    real = RingCopyEngine._start_waiting
    monkeypatch.setattr(RingCopyEngine, "_start_waiting", lambda self, key: (waited.append(key), real(self, key)))
    _train(opt, params, dtype=torch.bfloat16, clip=0.1)
    assert len(waited) >= 3 * (len(opt.layout().buckets) - slots)  # every step: all buckets past the ring waited
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert engines[0].d2h_ring.peak_in_use == slots


def test_a_group_added_later_with_a_larger_bucket_grows_the_slots_and_stays_bit_identical(monkeypatch):
    def run(slots):
        params = _params(torch.bfloat16)
        opt = _build(params[1:], torch.optim.AdamW, 1.0, slots)  # largest bucket: 63 elements
        _train(opt, params, steps=1, dtype=torch.bfloat16)
        opt.add_param_group({"params": params[:1]})  # a 91-element bucket
        _train(opt, params, steps=2, dtype=torch.bfloat16)
        return params, opt

    ref_params, _ = run(None)
    with monkeypatch.context() as m:
        engines = _ring_engines(m, 2)
        params, opt = run(2)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert engines[0].slot_bytes[0] >= max(b.numel for b in opt.layout().buckets) * 2


def test_a_ring_mode_state_dict_saves_only_state_and_resumes_a_full_pinning_optimizer_bit_identically(monkeypatch):
    ref_params = _params(torch.bfloat16)
    ref = _build(ref_params, torch.optim.AdamW, 1.0, None)
    _train(ref, ref_params, steps=2, dtype=torch.bfloat16)
    params = _params(torch.bfloat16)
    with monkeypatch.context() as m:
        _ring_engines(m, 1)
        opt = _build(params, torch.optim.AdamW, 1.0, 1)
        _train(opt, params, steps=2, dtype=torch.bfloat16)
    saved, ref_saved = io.BytesIO(), io.BytesIO()
    torch.save(opt.state_dict(), saved)
    torch.save(ref.state_dict(), ref_saved)
    assert saved.getbuffer().nbytes == ref_saved.getbuffer().nbytes  # the same tensors, no staging written
    saved.seek(0)
    resumed = _build(params, torch.optim.AdamW, 1.0, None)  # full pinning (the default) resumes it
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    _train(resumed, params, steps=1, dtype=torch.bfloat16)
    _train(ref, ref_params, steps=1, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_buckets_of_mixed_dtypes_and_an_empty_param_share_one_ring_bit_identically(monkeypatch):
    specs = [(50, torch.float32), (70, torch.bfloat16), (0, torch.float32), (33, torch.bfloat16), (41, torch.float32)]

    def run(slots):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(d)) for n, d in specs]
        opt = HybridDeviceOptimizer(params, 1.0, lr=0.05, bucket_numel=64, pinned_transfer_slots=slots)
        for step in range(3):
            sum((p.float() * (i + 1 + step)).sin().sum() for i, p in enumerate(params)).backward()
            opt.step()
            opt.zero_grad()
        return params, opt

    ref_params, _ = run(None)
    with monkeypatch.context() as m:
        engines = _ring_engines(m, 1)
        params, opt = run(1)
    assert {b.grad_dtype for b in opt.layout().buckets} == {torch.float32, torch.bfloat16}
    assert engines[0].slot_bytes == (200, 200)  # the largest bucket in bytes: 50 fp32 elements (not 70 bf16)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_without_an_accelerator_nothing_is_pinned_in_either_mode():
    for slots in (None, 2):
        opt = HybridDeviceOptimizer(_params(torch.float32), 1.0, lr=0.1, pinned_transfer_slots=slots)
        assert opt.pinned_bytes == 0


def test_the_construction_log_reports_the_slots_and_their_pinned_bytes(monkeypatch, caplog):
    caplog.set_level("INFO", logger="offload_fsdp.optimizer")
    with monkeypatch.context() as m:
        engines = _ring_engines(m, 3)
        _build(_params(torch.bfloat16), torch.optim.AdamW, 1.0, 3)
    (line,) = [r.getMessage() for r in caplog.records if "partition" in r.getMessage()]
    assert "pinned_transfer_slots=3, page-locked slot bytes 0" in line  # the emulated device pins nothing
    assert engines[0].slot_bytes == (184, 184)  # 91 bf16 elements, in whole words
    assert 3 * 2 * 184 <= engines[0].reserved_bytes < 3 * 2 * (184 + 64)


# ------------------------------------------------------------------ on a device


@pytest.mark.accelerator
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_device_ring_pinning_registers_only_the_slots_and_matches_full_pinning(dtype, monkeypatch):
    from tests.test_offload_cuda import _low_intensity_model, _train

    n = 1 << 16
    ref_model, model = (_low_intensity_model(n).to(dtype) for _ in range(2))  # 12 params, one bucket each
    ref = HybridDeviceOptimizer(ref_model.parameters(), 1.0, lr=1e-2, bucket_numel=n)
    made = _made_engines(monkeypatch)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=1e-2, bucket_numel=n, pinned_transfer_slots=2)
    assert ref.pinned_bytes >= 2 * sum(p.numel() * p.element_size() for p in ref_model.parameters())
    (engine,) = made
    assert isinstance(engine, RingCopyEngine) and engine.arena is not None and engine.arena.pinned
    assert engine.slot_bytes == (n * dtype.itemsize,) * 2 and len(opt.layout().buckets) == 12
    assert opt.pinned_bytes == engine.reserved_bytes == 4 * n * dtype.itemsize  # 2 slots per direction, nothing else
    assert opt.layout().arenas[0].used_bytes == 0  # masters, moments, staging: all pageable
    assert not any(b.pinned for b in opt.layout().buckets)
    # low arithmetic intensity: a forward that ran before its params' H2D landed would read stale values
    ours = _train(model, opt, 4, n, micro_batches=3, clip=0.5)
    theirs = _train(ref_model, ref, 4, n, micro_batches=3, clip=0.5)
    assert torch.equal(ours, theirs)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert engine.d2h_ring.peak_in_use == engine.h2d_ring.peak_in_use == 2


# ------------------------------------------------------------------ FSDP2 over gloo


def _fsdp_ring_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_offload_distributed import _model, _shard
    from tests.test_offload_distributed import _train as train_fsdp

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for slots in (None, 1):
        model = _shard(_model(), mesh)
        with pytest.MonkeyPatch.context() as m:
            if slots is not None:  # the emulated device, in this rank's process
                engines = _ring_engines(m, slots)
            opt = HybridDeviceOptimizer(model.parameters(), 1.0, lr=0.01, bucket_numel=8, pinned_transfer_slots=slots)
        train_fsdp(model, opt, 3, rank, micro_batches=2)
        results[slots] = [p.to_local().clone() for p in model.parameters()]
        if slots is not None:
            (engine,) = engines
            results["peak"] = engine.d2h_ring.peak_in_use
            results["ring_used"] = {b.copy_engine for b in opt.layout().buckets} == {"RingCopyEngine"} and len(
                opt.layout().buckets
            ) > 1
    results["equal"] = all(torch.equal(a, b) for a, b in zip(results[None], results[1]))
    return {k: results[k] for k in ("equal", "peak", "ring_used")}


@pytest.mark.parametrize("world_size", [3])  # uneven and empty local shards
def test_fsdp2_local_shards_through_a_one_slot_ring_match_full_pinning_bit_for_bit(world_size):
    from tests.distributed import run_ranks

    for result in run_ranks(_fsdp_ring_body, world_size):
        assert result == {"equal": True, "peak": 1, "ring_used": True}
