"""Benchmark of HybridDeviceOptimizer's host step (and, on a GPU, its overlap), printed as ratios.

Usage::

    python scripts/bench_offload.py                      # ~50M params in 100 tensors
    python scripts/bench_offload.py --numel 20e6 --tensors 40 --repeats 5
    python scripts/bench_offload.py --numel 20e6 --bucket-numel 4e6 --timeline-json t.json
    python scripts/plot_offload_timeline.py t.json -o timeline.png

All figures come from one run on one machine. On the CPU it compares the
offloaded path's host step (offload_fraction=1) with torch ``AdamW(fused=True)``
over the same parameters and with the memory-bandwidth roofline (bytes moved per
parameter / a copy bandwidth this script measures). With an accelerator (any that torch.accelerator reports) it adds: full step
time vs max(D2H, host step, H2D) each timed alone (overlap efficiency), bytes
over PCIe per parameter, a training iteration with offload_fraction=1 vs none,
and GPU memory saved. ``--host-step both`` (the default) times the compiled C
loop (the default host step, ``OFFLOAD_FSDP_HOST_STEP=auto``) and torch's fused
kernel in pieces (its fallback, ``OFFLOAD_FSDP_HOST_STEP=fused``) side by side in
the same rounds. It then splits each offload configuration's full ``step()`` into
its stages (grad copy, host step, param copy-back, and the Python rest), timed
by the optimizer's stage hook over the fastest of ``--repeats`` steps.

Every run also prints the cost of the per-step check that detects weights the
user wrote between steps (``--write-check-only``: just that row), as a fraction
of a full ``step()``.

``--ring-slots N`` adds, on an accelerator, full pinning vs a ring of N pinned
transfer slots (``pinned_transfer_slots=N``): page-locked bytes, time to
construct the optimizer (allocation, page-locking, master copies) and
``step()`` time of each (``--bucket-numel`` sets the bucket, hence slot, size).
``construction_cost`` is the same measurement for other scripts.

``--bind`` runs only the core-binding comparison (``bind_host_cores``): at 1 and 2
local ranks (processes started here with ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` set,
each with ``--numel`` params of its own, bf16 params and grads, fp32 state), every
rank times ``step()`` of an optimizer bound to its cores and of an unbound one over
the same params, in interleaved rounds that start together on all ranks (a barrier),
with ``torch.set_num_threads`` = its share of the cores in both. Printed: the
fastest and median step of each, the unbound / bound ratio, and each one's process
CPU time per step.

``--state-only-memory`` runs only, on an accelerator, the peak device memory of
``offload_state_only=True`` (unbounded, and with ``state_device_bytes`` = 1/4 of the
state) against the model alone and on-device AdamW, each run's bytes above what was
allocated before it (earlier runs garbage-collected first), and what stays allocated
between steps; under 90 s on one GPU at the defaults with ``--repeats 3``.

``--timeline-json PATH`` runs only the timeline probe: the fastest of a few
full ``step()`` calls (offload_fraction=1, bf16 params and grads), with the
start / end of every bucket's D2H, host step and H2D in ms from the step's
start (CUDA events on the copy streams on a GPU; on the CPU the copies are
synchronous and timed on the host), for ``scripts/plot_offload_timeline.py``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a plain `python scripts/...` finds the packages

from offload_fsdp import HybridDeviceOptimizer  # noqa: E402
from offload_fsdp.compiled_step import HOST_STEP_ENV, compiled_step_available  # noqa: E402
from offload_fsdp.copy_engine import StreamCopyEngine  # noqa: E402
from offload_fsdp.core_binding import format_cores  # noqa: E402
from offload_fsdp.optimizer import DEFAULT_BUCKET_NUMEL  # noqa: E402
from optim import PrecisionPolicy  # noqa: E402

BF16_STATE = PrecisionPolicy(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def _time(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Fastest of ``repeats`` timed runs after one warm-up (the least disturbed by other load)."""
    return _time_round_robin({"": fn}, repeats, sync)[""]


def _time_round_robin(
    fns: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Fastest run of each callable, timed in interleaved rounds so background load hits all alike."""
    for fn in fns.values():
        fn()
        sync()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _bandwidth_probe(nbytes: int) -> tuple[Callable[[], None], int]:
    """An in-place ``a += b`` over ``nbytes`` per operand, and the bytes it moves.

    In place, like the optimizer step (read a, read b, write a = 12 B/element): a copy
    into a separate buffer would also pay write-allocate reads and under-report it.
    It is timed in the same interleaved rounds as the steps: on a shared VM the
    bandwidth on offer drifts by 2x within minutes, so a probe timed apart from them
    gives a roofline for other conditions.
    """
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    return (lambda: a.add_(b)), 3 * nbytes


def _shapes(numel: int, tensors: int) -> list[int]:
    base = numel // tensors
    # uneven sizes around the mean, as in a real model (the sum stays ~numel)
    return [max(1, int(base * (0.5 + (i % 5) / 4))) for i in range(tensors)]


def _params(sizes: list[int], dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(device=device, dtype=dtype).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device=device, dtype=dtype) * 1e-2
    return params


def _host_step_only(opt: HybridDeviceOptimizer) -> Callable[[], None]:
    """The host update alone (no grad staging, no copy back), bucket by bucket, as step() runs it."""
    opt.materialize_state()

    def run() -> None:
        for bucket in opt._placement.buckets:
            assert bucket.kernel is not None  # AdamW: every bucket has the host kernel
            bucket.kernel.step_bucket(bucket, bucket.records, opt.param_groups[bucket.group_index], opt._host.scratch)

    return run


_PROBE = "bandwidth probe"


def bench_cpu(args: argparse.Namespace) -> None:
    sizes = _shapes(int(args.numel), args.tensors)
    n = sum(sizes)
    probe, probe_bytes = _bandwidth_probe(int(args.copy_mb * 2**20))
    fns: dict[str, Callable[[], None]] = {_PROBE: probe}
    meta: dict[str, tuple[int | None, float]] = {}  # name -> (bytes moved per param, host bytes per param)
    keep = []  # keeps every optimizer (and its params) alive while timing
    built: dict[str, float] = {}
    full_steps: dict[str, HybridDeviceOptimizer] = {}
    ref_params = _params(sizes, torch.float32, "cpu")
    for name, kw in (
        ("torch AdamW(fused=True), fp32", {"fused": True}),
        ("torch AdamW(foreach=True), fp32", {"foreach": True}),
    ):
        ref = torch.optim.AdamW(ref_params, lr=1e-3, **kw)
        keep.append(ref)
        fns[name], meta[name] = ref.step, (28, 16.0)
    configs = [
        ("offload fp32 params, fp32 state", torch.float32, None, 28),
        ("offload bf16 params+grads, fp32 state", torch.bfloat16, None, 28),
        ("offload fp32 params, bf16 state", torch.float32, BF16_STATE, 20),
        ("offload bf16 params+grads, bf16 state", torch.bfloat16, BF16_STATE, 20),
    ]
    env_before = os.environ.get(HOST_STEP_ENV)
    variants = [
        (step, f" ({step})" if args.host_step == "both" else "")
        for step in ("fused", "compiled")
        if args.host_step in (step, "both")
    ]
    for (name, dtype, precision, bytes_moved), (host_step, suffix) in itertools.product(configs, variants):
        if host_step == "compiled" and dtype == torch.float32 and precision is None:
            continue  # nothing to cast: the compiled step hands this bucket to the fused kernel anyway
        name += suffix
        params = _params(sizes, dtype, "cpu")
        os.environ[HOST_STEP_ENV] = host_step  # read once, at construction
        if host_step == "compiled" and "compiled" not in built:
            t0 = time.perf_counter()
            if not compiled_step_available():
                sys.exit("the compiled host step could not be built (see the warning above); use --host-step fused")
            built["compiled"] = time.perf_counter() - t0
        opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3, precision=precision)
        keep.append(opt)
        used = sum(t.numel() * t.element_size() for b in opt._placement.buckets
                   for t in [b.master, b.grad_stage, *([b.param_stage] if b.param_stage is not None else []), *b.state.values()])  # fmt: skip
        fns[name + " [host step]"], meta[name + " [host step]"] = _host_step_only(opt), (bytes_moved, used / n)
        # on a CPU-only machine step() adds the grad staging and copy-back copies (DMA on a GPU machine)
        fns[name + " [full step()]"], meta[name + " [full step()]"] = opt.step, (None, used / n)
        full_steps[name] = opt
    if env_before is None:
        os.environ.pop(HOST_STEP_ENV, None)
    else:
        os.environ[HOST_STEP_ENV] = env_before
    times = _time_round_robin(fns, args.repeats)
    bw = probe_bytes / times.pop(_PROBE)
    del fns[_PROBE]
    print(f"params: {n / 1e6:.1f}M in {len(sizes)} tensors; threads {torch.get_num_threads()}; "
          f"measured bandwidth {bw / 1e9:.1f} GB/s (in-place a += b, reads + writes, timed in the same rounds)")  # fmt: skip
    t_ref = times["torch AdamW(fused=True), fp32"]
    rows = [(name, times[name], *meta[name]) for name in fns]

    print(
        f"\n{'configuration':62s} {'time ms':>8s} {'vs fused':>9s} {'B/param':>8s} {'roofline ms':>11s} {'vs roof':>8s} {'host B/param':>12s}"
    )
    for name, t, moved, host_bytes in rows:
        roof = moved * n / bw if moved else None
        print(f"{name:62s} {t * 1e3:8.1f} {t / t_ref:8.2f}x {moved or '-':>8} "
              f"{(f'{roof * 1e3:.1f}' if roof else '-'):>11s} {(f'{t / roof:.2f}x' if roof else '-'):>8s} {host_bytes:12.1f}")  # fmt: skip
    print()
    for _, suffix in variants:
        fp32_state = times[f"offload bf16 params+grads, fp32 state{suffix} [host step]"]
        bf16_state = times[f"offload bf16 params+grads, bf16 state{suffix} [host step]"]
        print(f"bf16 / fp32 optimizer state host-step time (bf16 params){suffix}: {bf16_state / fp32_state:.2f}")
    if len(variants) == 2:
        for name, *_ in configs:
            key = f"{name} (compiled) [host step]"
            if key in times:
                print(f"compiled / fused host step, {name}: {times[key] / times[f'{name} (fused) [host step]']:.2f}")
    print(
        f"\nfull step() per stage (the fastest of {args.repeats} steps, each stage's calls summed; "
        "on the CPU the copies are synchronous host copies):"
    )
    for name, opt in full_steps.items():
        step_ms, busy = _stage_breakdown(opt, args.repeats)
        rest = step_ms - sum(busy.values())
        print(f"  {name}: step {step_ms:.1f} ms = grad copy {busy['d2h']:.1f} + host step {busy['host_step']:.1f} + "
              f"param copy-back {busy['h2d']:.1f} + Python/other {rest:.1f} ms ({step_ms / busy['host_step']:.2f}x the host step)")  # fmt: skip
    if "compiled" in built:
        print(f"compiled host step ready in {built['compiled']:.1f} s (C compile + self-check; ~0.1 s once cached)")


def bench_write_check(args: argparse.Namespace) -> None:
    """Cost of detecting user-written weights (a version-counter check per param) vs a full ``step()``.

    Every ``step()`` compares each offloaded param's version counter with the one
    recorded after its last write-back (``_refresh_written``); nothing was written
    here, so this is the check alone, as in every step of a run without writes.
    """
    sizes = _shapes(int(args.numel), args.tensors)
    device = _accelerator() or torch.device("cpu")
    params = _params(sizes, torch.bfloat16, device.type)
    opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3)
    opt.step()  # the first step's one-time comparison pass

    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize()

    times = _time_round_robin(
        {"step": opt.step, "check": lambda: opt._placement.refresh_written(opt._placement.records)}, args.repeats, sync
    )
    print(f"\nuser-write check (version counters of {len(sizes)} params, bf16, {sum(sizes) / 1e6:.1f}M elements, "
          f"offload_fraction=1, {device.type}): {times['check'] * 1e6:.1f} us per step vs step() "
          f"{times['step'] * 1e3:.1f} ms = {times['check'] / times['step']:.5f} of the step")  # fmt: skip


def _accelerator() -> torch.device | None:
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    module = torch.get_device_module(device)
    return module.get_device_name() if hasattr(module, "get_device_name") else device.type


def bench_gpu(args: argparse.Namespace) -> None:
    """Overlap efficiency, bus bytes, iteration time and memory saved (bf16 params and grads), on any accelerator."""
    device = _accelerator()
    _bench_copies(args, device)
    if args.ring_slots:
        _bench_pinning(args, device)
    n = sum(_shapes(int(args.numel), args.tensors))
    width = int((n / (2 * args.layers)) ** 0.5)
    t_dev, m_dev = _bench_iteration(args, device, width, None)
    t_off, m_off = _bench_iteration(args, device, width, 1.0)
    print(f"training iteration ({2 * args.layers} x Linear({width}), bf16, batch {args.batch}): "
          f"offload_fraction=1 {t_off * 1e3:.1f} ms vs on-device fp32-master AdamW {t_dev * 1e3:.1f} ms "
          f"= {t_off / t_dev:.2f}x; peak GPU memory {m_off / 2**30:.2f} GiB vs {m_dev / 2**30:.2f} GiB "
          f"(saved {(m_dev - m_off) / 2**30:.2f} GiB)")  # fmt: skip
    # state-only offload: updated on the device, fp32 masters + moments (12 bytes a param) parked on the host
    # (peak memory: unbounded, every bucket's state may be on the device during step(); bounded to ~2 buckets of 8)
    state_bytes = 12 * n
    # two buckets of n/8: 1/4 of the state, and their host buffers' 64-byte alignment (a few hundred bytes each)
    two_buckets = state_bytes // 4 + 4096
    for label, budget in (("unbounded", None), ("state_device_bytes = 1/4 of the state + 4 KiB", two_buckets)):
        t_so, m_so = _bench_iteration(
            args, device, width, 0.0, offload_state_only=True, state_device_bytes=budget, bucket_numel=n // 8
        )
        print(f"  offload_state_only ({label}): {t_so * 1e3:.1f} ms = {t_so / t_dev:.2f}x on-device AdamW; "
              f"peak GPU memory {m_so / 2**30:.2f} GiB (saved {(m_dev - m_so) / 2**30:.2f} GiB)")  # fmt: skip


def construction_cost(params: list[torch.Tensor], **options: object) -> tuple[HybridDeviceOptimizer, float, int]:
    """(optimizer, seconds to build it, its page-locked bytes): offload_fraction=1, AdamW, ``options``.

    The seconds cover allocating and page-locking the host buffers and copying the
    masters from the params; the device is synchronised before and after.
    """
    sync = torch.accelerator.synchronize if torch.accelerator.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3, **options)  # type: ignore[arg-type]
    sync()
    return opt, time.perf_counter() - start, opt.pinned_bytes


def _bench_pinning(args: argparse.Namespace, device: torch.device) -> None:
    """Full pinning vs a ring of ``--ring-slots`` transfer slots: pinned bytes, construction and step time."""
    params = _params(_shapes(int(args.numel), args.tensors), torch.bfloat16, device.type)
    print(f"\npinning ({sum(p.numel() for p in params) / 1e6:.0f}M bf16 params, buckets of "
          f"{int(args.bucket_numel) / 1e6:.1f}M elements):")  # fmt: skip
    for label, slots in (("full pinning", None), (f"ring of {args.ring_slots} slots", args.ring_slots)):
        opt, seconds, pinned = construction_cost(
            params, pinned_transfer_slots=slots, bucket_numel=int(args.bucket_numel)
        )
        t_step = _time(opt.step, args.repeats, torch.accelerator.synchronize)
        print(f"  {label}: pinned {pinned / 2**20:.1f} MiB, construction {seconds:.2f} s, "
              f"step {t_step * 1e3:.1f} ms")  # fmt: skip
        del opt
        gc.collect()  # unregisters its pinned memory before the next one pins


def _bench_copies(args: argparse.Namespace, device: torch.device) -> None:
    """D2H, host step and H2D timed alone and as one ``step()``: the overlap efficiency."""
    sync = torch.accelerator.synchronize
    params = _params(_shapes(int(args.numel), args.tensors), torch.bfloat16, device.type)
    opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3)
    grads = [p.grad for p in params]
    stages = [r.grad_stage for r in opt._placement.records]
    sources = [r.push_source for r in opt._placement.records]

    def d2h() -> None:
        for s, g in zip(stages, grads):
            s.copy_(g, non_blocking=True)

    def h2d() -> None:
        for p, s in zip(params, sources):
            p.detach().copy_(s, non_blocking=True)

    t_d2h, t_h2d = _time(d2h, args.repeats, sync), _time(h2d, args.repeats, sync)
    t_host = _time(_host_step_only(opt), args.repeats)
    t_step = _time(opt.step, args.repeats, sync)
    bound = max(t_d2h, t_host, t_h2d)
    pcie = opt._placement.buckets[0].grad_stage.element_size() + sources[0].element_size()
    print(f"\n{device.type} ({_device_name(device)}): D2H {t_d2h * 1e3:.1f} ms, host step {t_host * 1e3:.1f} ms, "
          f"H2D {t_h2d * 1e3:.1f} ms; step {t_step * 1e3:.1f} ms; overlap efficiency max/step = {bound / t_step:.2f}; "
          f"sum/step = {(t_d2h + t_host + t_h2d) / t_step:.2f}; bytes over PCIe per param: {pcie} "
          f"(D2H {opt._placement.buckets[0].grad_stage.element_size()} + H2D {sources[0].element_size()})")  # fmt: skip


def _bench_iteration(
    args: argparse.Namespace, device: torch.device, width: int, fraction: float | None, **options: object
) -> tuple[float, int]:
    """(seconds per training iteration, peak device bytes); ``fraction=None``: fp32-master AdamW on the device;
    ``options`` go to HybridDeviceOptimizer."""
    _fresh_device_memory()
    iteration = _iteration(args, device, width, fraction, **options)
    return _time(iteration, args.repeats, torch.accelerator.synchronize), torch.accelerator.max_memory_allocated()


def _fresh_device_memory() -> int:
    """Free what earlier runs left and reset the peaks; the device bytes still allocated (the baseline)."""
    gc.collect()  # an earlier run's optimizer (held in reference cycles) would keep its model and state
    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    return torch.accelerator.memory_allocated()


def _iteration(
    args: argparse.Namespace,
    device: torch.device,
    width: int,
    fraction: float | None,
    *,
    step: bool = True,
    **options: object,
) -> Callable[[], None]:
    """One training iteration of the 2*layers x Linear(width) bf16 model (built here) at batch ``--batch``;
    ``fraction=None``: fp32-master AdamW on the device; ``step=False``: forward and backward only."""
    layers = [torch.nn.Linear(width, width) for _ in range(2 * args.layers)]
    model = torch.nn.Sequential(*layers).to(device).bfloat16()
    params = list(model.parameters())
    if fraction is None:
        masters = [p.detach().float().requires_grad_() for p in params]
        inner = torch.optim.AdamW(masters, lr=1e-4, fused=True)

        def opt_step() -> None:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
            inner.step()
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
    else:
        opt_step = HybridDeviceOptimizer(params, fraction, lr=1e-4, **options).step  # type: ignore[arg-type]
    x = torch.randn(args.batch, width, device=device, dtype=torch.bfloat16)

    def iteration() -> None:
        model(x).float().square().mean().backward()
        if step:
            opt_step()
        model.zero_grad(set_to_none=False)

    return iteration


def bench_state_only_memory(args: argparse.Namespace) -> None:
    """Peak device memory of state-only offload against its ``state_device_bytes`` budget, on an accelerator.

    The iteration rows' model (2*layers x Linear, bf16, batch ``--batch``), ``--repeats`` iterations each:
    the model alone (forward + backward, no step: params, grads, activations), on-device fp32-master
    AdamW, and AdamW with ``offload_state_only=True`` unbounded and with ``state_device_bytes`` = 1/4 of
    the state (fp32 master + two moments, 12 B/param) in buckets of n/8. Bytes are above what was
    allocated before each run (earlier runs collected first); "state" is a run's peak above the model
    alone's, the device memory its optimizer needed; "between steps" is what stays allocated once the
    device is idle after a step, above the model alone's.
    """
    device = _accelerator()
    if device is None:
        print("(no accelerator: nothing to measure)")
        return
    n = sum(_shapes(int(args.numel), args.tensors))
    width = int((n / (2 * args.layers)) ** 0.5)
    n = 2 * args.layers * (width * width + width)
    state_bytes, bucket = 12 * n, n // 8
    budget = state_bytes // 4 + 4096  # two buckets of n/8, and their host buffers' 64-byte alignment
    runs: dict[str, tuple[float | None, int | None, dict[str, Any]]] = {
        "model alone (no step)": (None, None, {"step": False}),
        "on-device fp32-master AdamW": (None, None, {}),
        "state-only, unbounded": (0.0, None, {"offload_state_only": True, "bucket_numel": bucket}),
        "state-only, state_device_bytes = state/4 + 4 KiB": (0.0, budget, {"offload_state_only": True,
                                                      "state_device_bytes": budget, "bucket_numel": bucket}),
    }  # fmt: skip
    print(f"state-only device memory ({_device_name(device)}; {2 * args.layers} x Linear({width}), bf16, "
          f"{n / 1e6:.1f}M params, batch {args.batch}, {args.repeats} iterations; state {state_bytes / 2**20:.0f} MiB, "
          f"buckets of {bucket / 1e6:.2f}M params = {12 * bucket / 2**20:.0f} MiB of state):")  # fmt: skip
    # One-time device allocations of the first forward/backward (BLAS workspaces) stay allocated: made here,
    # they are in every run's baseline. (Made in the first run instead, they once read as -256 MiB of state.)
    warm_up = _iteration(args, device, width, None, step=False)
    warm_up()
    del warm_up
    model_peak: int | None = None
    model_between = 0
    for label, (fraction, budget, options) in runs.items():
        base = _fresh_device_memory()
        iteration = _iteration(args, device, width, fraction, **options)
        for _ in range(args.repeats):
            iteration()
        torch.accelerator.synchronize()
        between = torch.accelerator.memory_allocated() - base
        peak = torch.accelerator.max_memory_allocated() - base
        reserved = torch.accelerator.max_memory_reserved() - base
        del iteration
        if model_peak is None:  # the first run: the model alone
            model_peak, model_between = peak, between
        line = (f"  {label}: peak allocated {peak / 2**20:.0f} MiB (state {(peak - model_peak) / 2**20:.0f} MiB), "
                f"peak reserved {reserved / 2**20:.0f} MiB, between steps {(between - model_between) / 2**20:.0f} MiB")  # fmt: skip
        if budget is not None:
            # The budget counts masters + state; the update of one bucket also holds its grads cast to fp32 and
            # foreach AdamW's one fp32 temporary (4 + 4 B/param), outside it
            limit = budget + 8 * bucket
            line += (f"; budget {budget / 2**20:.0f} MiB + {8 * bucket / 2**20:.0f} MiB for one bucket's update: "
                     f"{'within' if peak - model_peak <= limit else 'OVER'}")  # fmt: skip
        print(line)


class _StageClock:
    """``HybridDeviceOptimizer._trace.hook`` (:class:`offload_fsdp.trace.PhaseTrace`) recording each bucket's stage spans, in ms from :meth:`start`.

    Copies on a side stream are timed by events recorded on that stream; host work
    (and synchronous copies) by the host clock, started at the same instant as the
    origin event (the device is idle then).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[str, int, bool, float | torch.Event]] = []
        self._t0 = 0.0
        self._origin: torch.Event | None = None

    def start(self) -> None:
        self.marks.clear()
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
            self._origin = torch.Event(self.device, enable_timing=True)
            torch.accelerator.current_stream(self.device).record_event(self._origin)
        self._t0 = time.perf_counter()

    def __call__(self, stage: str, bucket, is_begin: bool) -> None:
        engine = bucket.engine
        if stage == "host_step" or not isinstance(engine, StreamCopyEngine):
            self.marks.append((stage, bucket.index, is_begin, time.perf_counter()))
            return
        stream = engine.d2h_stream if stage == "d2h" else engine.h2d_stream
        if stage == "d2h" and is_begin:
            # the copy itself waits for the main stream (grads ready): so does its start mark
            stream.wait_stream(torch.accelerator.current_stream(self.device))
        event = torch.Event(self.device, enable_timing=True)
        stream.record_event(event)
        self.marks.append((stage, bucket.index, is_begin, event))

    def now(self) -> float | torch.Event:
        if self._origin is None:
            return time.perf_counter()
        event = torch.Event(self.device, enable_timing=True)
        torch.accelerator.current_stream(self.device).record_event(event)
        return event

    def ms(self, mark: float | torch.Event) -> float:
        if isinstance(mark, float):
            return (mark - self._t0) * 1e3
        return self._origin.elapsed_time(mark)

    def busy(self) -> dict[str, float]:
        """stage -> ms spent in it, each begin/end pair summed (exact for host-timed stages)."""
        if self._origin is not None:
            torch.accelerator.synchronize(self.device)
        out = {"d2h": 0.0, "host_step": 0.0, "h2d": 0.0}
        begun: dict[tuple[str, int], float] = {}
        for stage, index, is_begin, mark in self.marks:
            if is_begin:
                begun[stage, index] = self.ms(mark)
            else:
                out[stage] += self.ms(mark) - begun.pop((stage, index))
        return out

    def spans(self) -> dict[int, dict[str, list[float]]]:
        """bucket index -> stage -> [first start, last end] (a bucket's D2H is one copy per grad)."""
        if self._origin is not None:
            torch.accelerator.synchronize(self.device)
        out: dict[int, dict[str, list[float]]] = {}
        for stage, index, is_begin, mark in self.marks:
            span = out.setdefault(index, {}).setdefault(stage, [float("inf"), float("-inf")])
            t = self.ms(mark)
            span[0 if is_begin else 1] = min(span[0], t) if is_begin else max(span[1], t)
        return out


def _stage_breakdown(opt: HybridDeviceOptimizer, repeats: int) -> tuple[float, dict[str, float]]:
    """(step ms, stage -> ms) of the fastest of ``repeats`` full ``step()`` calls, timed by the stage hook."""
    clock = _StageClock(torch.device("cpu"))
    best = (float("inf"), {})
    for _ in range(repeats):
        clock.start()
        opt._trace.hook = clock
        opt.step()
        step_ms = clock.ms(clock.now())
        opt._trace.hook = None
        if step_ms < best[0]:
            best = (step_ms, clock.busy())
    return best


def record_timeline(args: argparse.Namespace) -> None:
    """Write the per-bucket stage spans of the fastest of a few full steps to ``args.timeline_json``."""
    device = _accelerator() or torch.device("cpu")
    sizes = _shapes(int(args.numel), args.tensors)
    params = _params(sizes, torch.bfloat16, device.type)
    opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3, bucket_numel=int(args.bucket_numel))
    clock = _StageClock(device)
    opt.step()  # warm-up: lazy state, scratch buffers, first-touch costs
    best = None
    for _ in range(max(1, min(args.repeats, 3))):
        clock.start()
        opt._trace.hook = clock
        opt.step()
        end = clock.now()
        opt._trace.hook = None
        spans = clock.spans()
        step_ms = clock.ms(end)
        if best is None or step_ms < best[0]:
            best = (step_ms, spans)
    step_ms, spans = best
    numel = {b.index: b.numel for b in opt._placement.buckets}
    data = {
        "format": "offload_timeline",
        "version": 1,
        "device": _device_name(device),
        "unit": "ms",
        "params": sum(sizes),
        "step": [0.0, step_ms],
        "buckets": [{"index": i, "numel": numel[i], **spans[i]} for i in sorted(spans)],
    }
    Path(args.timeline_json).write_text(json.dumps(data, indent=1) + "\n")
    busy = {s: sum(b[s][1] - b[s][0] for b in spans.values() if s in b) for s in ("d2h", "host_step", "h2d")}
    print(f"{sum(sizes) / 1e6:.1f}M bf16 params in {len(spans)} buckets on {data['device']}: step {step_ms:.1f} ms; "
          f"D2H {busy['d2h']:.1f} / host step {busy['host_step']:.1f} / H2D {busy['h2d']:.1f} ms summed per stage; "
          f"max/step = {max(busy.values()) / step_ms:.2f}; wrote {args.timeline_json}")  # fmt: skip


def _bind_rank(rank: int, world: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    """One local rank of ``--bind``: best / median ``step()`` seconds and CPU seconds, bound and unbound."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    params = _params(_shapes(int(args.numel), args.tensors), torch.bfloat16, "cpu")
    opts = {bound: HybridDeviceOptimizer(params, 1.0, lr=1e-3, bind_host_cores=bound) for bound in (True, False)}
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.repeats + 1):  # the first round warms up (state, compiled step)
        for bound, opt in opts.items():
            barrier.wait()  # every rank steps at once: the contention binding is meant to remove
            wall, cpu = time.perf_counter(), time.process_time()
            opt.step()
            times[bound].append((time.perf_counter() - wall, time.process_time() - cpu))
    cores = {bound: opt.host_cores for bound, opt in opts.items()}
    results.put((rank, {b: t[1:] for b, t in times.items()}, cores[True]))


def bench_bind(args: argparse.Namespace) -> None:
    import multiprocessing
    import statistics

    ctx = multiprocessing.get_context("spawn")
    print(f"--bind: {args.numel / 1e6:.1f}M bf16 params per rank, {args.repeats} rounds; "
          f"{len(os.sched_getaffinity(0))} allowed cores; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'local ranks':>11s} {'rank':>4s} {'cores':>6s} {'bound ms':>9s} {'unbound ms':>10s} "
          f"{'median b/u ms':>14s} {'unbound/bound':>13s} {'cpu ms b/u':>11s}")  # fmt: skip
    for world in (1, 2):
        barrier, results = ctx.Barrier(world), ctx.Queue()
        procs = [ctx.Process(target=_bind_rank, args=(r, world, args, barrier, results)) for r in range(world)]
        for p in procs:
            p.start()
        rows = sorted(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
        for rank, times, cores in rows:
            best = {b: min(w for w, _ in t) for b, t in times.items()}
            median = {b: statistics.median(w for w, _ in t) for b, t in times.items()}
            cpu = {b: statistics.median(c for _, c in t) for b, t in times.items()}
            print(f"{world:11d} {rank:4d} {format_cores(cores or ()):>6s} {best[True] * 1e3:9.1f} "
                  f"{best[False] * 1e3:10.1f} {median[True] * 1e3:6.1f}/{median[False] * 1e3:<7.1f} "
                  f"{median[False] / median[True]:13.2f} {cpu[True] * 1e3:5.0f}/{cpu[False] * 1e3:<5.0f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=50e6, help="total parameters (default 50M)")
    parser.add_argument("--tensors", type=int, default=100, help="number of parameter tensors (default 100)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the fastest is reported")
    parser.add_argument("--copy-mb", type=float, default=512, help="size of each bandwidth-probe operand in MiB")
    parser.add_argument("--layers", type=int, default=8, help="GPU iteration model: 2*layers square Linear layers")
    parser.add_argument("--batch", type=int, default=4096, help="GPU iteration batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--host-step", choices=("fused", "compiled", "both"), default="both",
                        help="host Adam step(s) to time on the CPU: the compiled C loop (the default host step), "
                             "torch's fused kernel in pieces (its fallback, OFFLOAD_FSDP_HOST_STEP=fused), or both")  # fmt: skip
    parser.add_argument("--timeline-json", default=None, metavar="PATH",
                        help="only record per-bucket D2H / host step / H2D spans of one step into PATH "
                             "(draw with scripts/plot_offload_timeline.py)")  # fmt: skip
    parser.add_argument("--bucket-numel", type=float, default=float(DEFAULT_BUCKET_NUMEL),
                        help="elements per host bucket for --timeline-json and --ring-slots (default 16M)")  # fmt: skip
    parser.add_argument("--ring-slots", type=int, default=None, metavar="N",
                        help="on an accelerator, also compare full pinning with pinned_transfer_slots=N: "
                             "pinned bytes, construction time, step time")  # fmt: skip
    parser.add_argument("--bind", action="store_true",
                        help="only compare step() with and without bind_host_cores at 1 and 2 local ranks")  # fmt: skip
    parser.add_argument("--state-only-memory", action="store_true",
                        help="only measure state-only offload's peak device memory against its budget")  # fmt: skip
    parser.add_argument(
        "--write-check-only",
        action="store_true",
        help="only time the per-step check for weights written by the user, as a share of step()",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.timeline_json:
        record_timeline(args)
        return
    if args.bind:
        bench_bind(args)
        return
    if args.state_only_memory:
        bench_state_only_memory(args)
        return
    if not args.write_check_only:
        bench_cpu(args)
    bench_write_check(args)
    if args.write_check_only:
        return
    if _accelerator() is not None:
        bench_gpu(args)
    else:
        print("\n(no accelerator: device figures skipped)")


if __name__ == "__main__":
    main()
