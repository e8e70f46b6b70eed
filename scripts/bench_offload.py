"""Benchmark of HybridDeviceOptimizer's host step (and, on a GPU, its overlap), printed as ratios.

Usage::

    python scripts/bench_offload.py                      # ~50M params in 100 tensors
    python scripts/bench_offload.py --numel 20e6 --tensors 40 --repeats 5

All figures come from one run on one machine. On the CPU it compares the
offloaded path's host step (offload_fraction=1) with torch ``AdamW(fused=True)``
over the same parameters and with the memory-bandwidth roofline (bytes moved per
parameter / a copy bandwidth this script measures). With CUDA it adds: full step
time vs max(D2H, host step, H2D) each timed alone (overlap efficiency), bytes
over PCIe per parameter, a training iteration with offload_fraction=1 vs none,
and GPU memory saved.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a plain `python scripts/...` finds the packages

from offload_fsdp import HybridDeviceOptimizer  # noqa: E402
from offload_fsdp.fused_step import AdamHyper, adam_bucket_step  # noqa: E402
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


def _stream_bandwidth(nbytes: int, repeats: int) -> float:
    """Host memory bandwidth in bytes/s from an in-place ``a += b`` over ``nbytes`` per operand.

    In place, like the optimizer step (read a, read b, write a = 12 B/element): a copy
    into a separate buffer would also pay write-allocate reads and under-report it.
    """
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    return 3 * nbytes / _time(lambda: a.add_(b), repeats)


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
    hyper = AdamHyper.from_group(opt.param_groups[0], decoupled_default=True)

    def run() -> None:
        for bucket in opt._buckets:
            torch._foreach_add_([r.state["step"] for r in bucket.records], 1.0)
            adam_bucket_step(bucket, bucket.records, hyper, opt._scratch)

    return run


def bench_cpu(args: argparse.Namespace) -> None:
    sizes = _shapes(int(args.numel), args.tensors)
    n = sum(sizes)
    bw = _stream_bandwidth(int(args.copy_mb * 2**20), args.repeats)
    print(f"params: {n / 1e6:.1f}M in {len(sizes)} tensors; threads {torch.get_num_threads()}; "
          f"measured bandwidth {bw / 1e9:.1f} GB/s (in-place a += b, reads + writes)")  # fmt: skip

    fns: dict[str, Callable[[], None]] = {}
    meta: dict[str, tuple[int | None, float]] = {}  # name -> (bytes moved per param, host bytes per param)
    keep = []  # keeps every optimizer (and its params) alive while timing
    ref_params = _params(sizes, torch.float32, "cpu")
    for name, kw in (("torch AdamW(fused=True), fp32", {"fused": True}), ("torch AdamW(foreach=True), fp32", {"foreach": True})):
        ref = torch.optim.AdamW(ref_params, lr=1e-3, **kw)
        keep.append(ref)
        fns[name], meta[name] = ref.step, (28, 16.0)
    configs = [
        ("offload fp32 params, fp32 state", torch.float32, None, 28),
        ("offload bf16 params+grads, fp32 state", torch.bfloat16, None, 28),
        ("offload fp32 params, bf16 state", torch.float32, BF16_STATE, 20),
        ("offload bf16 params+grads, bf16 state", torch.bfloat16, BF16_STATE, 20),
    ]
    for name, dtype, precision, bytes_moved in configs:
        params = _params(sizes, dtype, "cpu")
        opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3, precision=precision)
        keep.append(opt)
        used = sum(t.numel() * t.element_size() for b in opt._buckets
                   for t in [b.master, b.grad_stage, *([b.param_stage] if b.param_stage is not None else []), *b.state.values()])  # fmt: skip
        fns[name + " [host step]"], meta[name + " [host step]"] = _host_step_only(opt), (bytes_moved, used / n)
        # on a CPU-only machine step() adds the grad staging and copy-back copies (DMA on a GPU machine)
        fns[name + " [full step()]"], meta[name + " [full step()]"] = opt.step, (None, used / n)
    times = _time_round_robin(fns, args.repeats)
    t_ref = times["torch AdamW(fused=True), fp32"]
    rows = [(name, times[name], *meta[name]) for name in fns]

    print(f"\n{'configuration':52s} {'time ms':>8s} {'vs fused':>9s} {'B/param':>8s} {'roofline ms':>11s} {'vs roof':>8s} {'host B/param':>12s}")
    for name, t, moved, host_bytes in rows:
        roof = moved * n / bw if moved else None
        print(f"{name:52s} {t * 1e3:8.1f} {t / t_ref:8.2f}x {moved or '-':>8} "
              f"{(f'{roof * 1e3:.1f}' if roof else '-'):>11s} {(f'{t / roof:.2f}x' if roof else '-'):>8s} {host_bytes:12.1f}")  # fmt: skip
    fp32_state = next(t for name, t, *_ in rows if name == "offload bf16 params+grads, fp32 state [host step]")
    bf16_state = next(t for name, t, *_ in rows if name == "offload bf16 params+grads, bf16 state [host step]")
    print(f"\nbf16 / fp32 optimizer state host-step time (bf16 params): {bf16_state / fp32_state:.2f}")


def bench_gpu(args: argparse.Namespace) -> None:
    """Overlap efficiency, PCIe bytes, iteration time and memory saved (bf16 params and grads)."""
    sizes = _shapes(int(args.numel), args.tensors)
    n = sum(sizes)
    sync = torch.cuda.synchronize
    params = _params(sizes, torch.bfloat16, "cuda")
    opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3)
    grads = [p.grad for p in params]
    stages = [r.grad_stage for r in opt._records]
    sources = [r.push_source for r in opt._records]

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
    pcie = (opt._buckets[0].grad_stage.element_size() + sources[0].element_size())
    print(f"\nGPU ({torch.cuda.get_device_name()}): D2H {t_d2h * 1e3:.1f} ms, host step {t_host * 1e3:.1f} ms, "
          f"H2D {t_h2d * 1e3:.1f} ms; step {t_step * 1e3:.1f} ms; overlap efficiency max/step = {bound / t_step:.2f}; "
          f"sum/step = {(t_d2h + t_host + t_h2d) / t_step:.2f}; bytes over PCIe per param: {pcie} "
          f"(D2H {opt._buckets[0].grad_stage.element_size()} + H2D {sources[0].element_size()})")  # fmt: skip
    del opt, params, grads

    width = int((n / (2 * args.layers)) ** 0.5)
    results = {}
    for fraction in (None, 1.0):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(2 * args.layers)]).cuda().bfloat16()
        if fraction is None:
            masters = [p.detach().float().requires_grad_() for p in model.parameters()]
            inner = torch.optim.AdamW(masters, lr=1e-4, fused=True)

            def opt_step() -> None:
                for m, p in zip(masters, model.parameters()):
                    m.grad = p.grad.float()
                inner.step()
                with torch.no_grad():
                    for m, p in zip(masters, model.parameters()):
                        p.copy_(m)
        else:
            hybrid = HybridDeviceOptimizer(model.parameters(), fraction, lr=1e-4)
            opt_step = hybrid.step
        x = torch.randn(args.batch, width, device="cuda", dtype=torch.bfloat16)

        def iteration() -> None:
            model(x).float().square().mean().backward()
            opt_step()
            model.zero_grad(set_to_none=False)

        results[fraction] = (_time(iteration, args.repeats, sync), torch.cuda.max_memory_allocated())
        del model
    (t_dev, m_dev), (t_off, m_off) = results[None], results[1.0]
    print(f"training iteration ({2 * args.layers} x Linear({width}), bf16, batch {args.batch}): "
          f"offload_fraction=1 {t_off * 1e3:.1f} ms vs on-device fp32-master AdamW {t_dev * 1e3:.1f} ms "
          f"= {t_off / t_dev:.2f}x; peak GPU memory {m_off / 2**30:.2f} GiB vs {m_dev / 2**30:.2f} GiB "
          f"(saved {(m_dev - m_off) / 2**30:.2f} GiB)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=50e6, help="total parameters (default 50M)")
    parser.add_argument("--tensors", type=int, default=100, help="number of parameter tensors (default 100)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the fastest is reported")
    parser.add_argument("--copy-mb", type=float, default=512, help="size of each bandwidth-probe operand in MiB")
    parser.add_argument("--layers", type=int, default=8, help="GPU iteration model: 2*layers square Linear layers")
    parser.add_argument("--batch", type=int, default=4096, help="GPU iteration batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_cpu(args)
    if torch.cuda.is_available():
        bench_gpu(args)
    else:
        print("\n(no CUDA device: GPU figures skipped)")


if __name__ == "__main__":
    main()
