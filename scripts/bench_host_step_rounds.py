"""One round of the host-step figures in the README: bf16 params (20M in 40 tensors), bf16 moments, 1 thread.

Prints one JSON line: the host step alone (``bench_offload.py``'s), the full ``step()``, its
stages (grad copy, host step, param copy-back, the rest) and the ``a += b`` roofline probe,
medians over ``--steps`` steps, all in this thread's CPU time (``time.thread_time``), which
other jobs on a shared host stretch far less than wall-clock time. Compare two trees by
alternating fresh processes, e.g.::

    for i in 1 2 3 4 5 6 7; do for tree in /tmp/old /work/new; do
        (cd $tree && PYTHONPATH=$tree python /work/new/scripts/bench_host_step_rounds.py); done; done
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OFFLOAD_FSDP_HOST_STEP", "compiled")
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))  # the tree under test's bench_offload
import bench_offload  # noqa: E402
from bench_offload import BF16_STATE, _bandwidth_probe, _host_step_only, _params, _shapes, _StageClock  # noqa: E402

from offload_fsdp import HybridDeviceOptimizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--numel", type=float, default=20e6)
    parser.add_argument("--tensors", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_offload.time.perf_counter = time.thread_time  # the stage clock in this thread's CPU time too
    numel = int(args.numel)
    params = _params(_shapes(numel, args.tensors), torch.bfloat16, "cpu")
    opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3, precision=BF16_STATE)
    host = _host_step_only(opt)
    probe, probe_bytes = _bandwidth_probe(512 * 2**20)
    for _ in range(3):
        host()
        opt.step()

    def ms(fn) -> float:
        start = time.thread_time()
        fn()
        return (time.thread_time() - start) * 1e3

    hosts, fulls, probes = [], [], []
    for _ in range(args.steps):  # interleaved, so drift hits all three alike
        hosts.append(ms(host))
        probes.append(ms(probe))
        fulls.append(ms(opt.step))
    clock, stages = _StageClock(torch.device("cpu")), []
    for _ in range(args.steps):
        clock.start()
        opt._trace.hook = clock
        opt.step()
        step_ms = clock.ms(clock.now())
        opt._trace.hook = None
        busy = clock.busy()
        stages.append({"step": step_ms, **busy, "other": step_ms - sum(busy.values())})
    roof = 20 * numel / (probe_bytes / statistics.median(probes))  # ms: 20 B/param at the probe's rate
    host_ms = statistics.median(hosts)
    out = {
        "roofline_ms": roof,
        "host_vs_roofline": host_ms / roof,
        "host_ms": host_ms,
        "step_ms": statistics.median(fulls),
    }
    out.update({f"stage_{k}_ms": statistics.median(s[k] for s in stages) for k in stages[0]})
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
