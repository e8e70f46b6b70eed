"""Benchmark fsdp-ckpt export / reshard: throughput and peak memory, as ratios measured in one run.

    python scripts/bench_convert.py                      # ~1 GiB checkpoint, tensors <= 256 MiB
    python scripts/bench_convert.py --size-gib 3 --max-tensor-mib 256 --dir /nvme/tmp

Builds a checkpoint at 2 ranks with the format's own writer (``checkpoint.write_rank``
+ ``checkpoint.commit``; chunks <= 64 MiB), then times, each in a fresh
subprocess whose peak RSS comes from ``os.wait4``:

* raw copy: read every file of the checkpoint and write it to one new file, fsync
  (the storage's own speed for these bytes: the bar to compare against);
* ``fsdp-ckpt export --format safetensors`` and ``--format torch``;
* ``fsdp-ckpt reshard --world-size 3``;
* ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (+ fsync of its output).

Every operation reads a warm page cache (the checkpoint was just written), so
the ratios compare the tools' work, not the disk's cold-read speed. ``--plain``
also times export from a single-process ``dcp.save`` of the same tensors
(one chunk per tensor: the worst case for peak memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tensor_sizes(total_bytes: int, max_tensor_bytes: int) -> list[int]:
    """A model-like mix: one tensor at the maximum (an embedding), then quarter / sixteenth / 1 MiB ones."""
    cycle = [max_tensor_bytes // 4, max_tensor_bytes // 4, max_tensor_bytes // 16, 1 << 20]
    sizes = [max_tensor_bytes]
    while sum(sizes) < total_bytes:
        sizes.append(max(min(cycle[len(sizes) % len(cycle)], total_bytes - sum(sizes)), 4096))
    return sizes


def build_source(path: Path, total_bytes: int, max_tensor_bytes: int, plain: Path | None) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    import checkpoint

    cols = 1024
    state = {}
    for i, nbytes in enumerate(_tensor_sizes(total_bytes, max_tensor_bytes)):
        rows = max(nbytes // (4 * cols), 1)
        name = f"model.layers.{i}.weight" if i % 2 == 0 else f"optimizer.state.layers.{i - 1}.weight.exp_avg"
        state[name] = torch.randn(rows, cols)
    state["extra.step"] = 100
    for rank in range(2):
        local = {}
        for key, t in state.items():
            if not isinstance(t, torch.Tensor):
                local[key] = t
                continue
            per = -(-t.shape[0] // 2)
            start = min(rank * per, t.shape[0])
            rows = min(per, t.shape[0] - start)
            local[key] = checkpoint.shard(t[start : start + rows], tuple(t.shape), offsets=(start, 0))
        checkpoint.write_rank(path, rank, 2, local)
    checkpoint.commit(path, 2)
    if plain is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(plain), no_dist=True)
    tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
    return {
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "largest": max(t.numel() * t.element_size() for t in tensors),
        "count": len(tensors),
    }


def measure(argv: list[str]) -> tuple[float, int]:
    """Seconds of work (timed inside the child, after its imports) and peak RSS in bytes of one subprocess."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{err}")
    return float(out.strip().splitlines()[-1]), usage.ru_maxrss * 1024  # Linux reports KiB


_TIMED = """
import os, sys, time
{imports}
t = time.perf_counter()
{body}
print(time.perf_counter() - t)
"""

_RAW_COPY = _TIMED.format(
    imports="",
    body="""
buf = bytearray(64 << 20)
with open(sys.argv[2], "wb") as out:
    for name in sorted(os.listdir(sys.argv[1])):
        with open(os.path.join(sys.argv[1], name), "rb", buffering=0) as f:
            while n := f.readinto(buf):
                out.write(memoryview(buf)[:n])
    out.flush(); os.fsync(out.fileno())
""",
)

_DCP_TO_TORCH = _TIMED.format(
    imports="from torch.distributed.checkpoint.format_utils import dcp_to_torch_save",
    body="""
dcp_to_torch_save(sys.argv[1], sys.argv[2])
with open(sys.argv[2], "rb+") as f:
    os.fsync(f.fileno())
""",
)

# stdout of the CLI goes to stderr so the last stdout line is the time
_CLI = _TIMED.format(
    imports="import contextlib, checkpoint.tool.cli",
    body="""
with contextlib.redirect_stdout(sys.stderr):
    code = checkpoint.tool.cli.main(sys.argv[1:])
assert code == 0, code
""",
)

_IMPORT_ONLY = _TIMED.format(imports="import torch, checkpoint.tool.cli", body="")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--max-tensor-mib", type=int, default=256)
    p.add_argument("--dir", default="/tmp/bench_convert")
    p.add_argument("--plain", action="store_true", help="also export from a plain single-process dcp.save")
    p.add_argument("--repeat", type=int, default=3, help="rounds; each operation keeps its fastest time")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    work = Path(args.dir)
    src = work / "src"
    if args.build_only:
        # runs in a child: a fork of a parent that held the tensors would inherit its peak RSS
        info = build_source(
            src, int(args.size_gib * 2**30), args.max_tensor_mib << 20, work / "plain" if args.plain else None
        )
        print(json.dumps(info))
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    built = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--build-only"], capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"building the source failed:\n{built.stderr}")
    info = json.loads(built.stdout.strip().splitlines()[-1])
    print(
        f"source: {info['count']} tensors, {info['bytes'] / 2**30:.2f} GiB, largest {info['largest'] / 2**20:.0f} MiB, "
        f"2 ranks (built in {time.perf_counter() - t0:.1f} s)"
    )
    py = sys.executable
    cli = [py, "-c", _CLI]
    runs = {
        "python + torch import only": [py, "-c", _IMPORT_ONLY],
        "raw copy of the bytes (fsync)": [py, "-c", _RAW_COPY, str(src), str(work / "raw.bin")],
        "fsdp-ckpt export safetensors": cli + ["export", src, work / "hf", "--format", "safetensors", "-q"],
        "fsdp-ckpt export torch": cli + ["export", src, work / "out.pt", "--format", "torch", "-q"],
        "fsdp-ckpt reshard 2 -> 3": cli + ["reshard", src, work / "w3", "--world-size", "3", "-q"],
        "dcp_to_torch_save (+ fsync)": [py, "-c", _DCP_TO_TORCH, str(src), str(work / "dcp.pt")],
    }
    if args.plain:
        runs["fsdp-ckpt export safetensors (plain dcp.save src)"] = cli + [
            "export",
            work / "plain",
            work / "hf_plain",
            "--format",
            "safetensors",
            "-q",
        ]
    results: dict[str, tuple[float, int]] = {}
    # rounds over all operations (not one operation N times in a row), so slow spells of a
    # shared disk hit every operation alike; each keeps its fastest time and largest peak
    for _ in range(args.repeat):
        for label, argv in runs.items():
            seconds, rss = measure([str(a) for a in argv])
            best = results.get(label, (float("inf"), 0))
            results[label] = (min(best[0], seconds), max(best[1], rss))
            for out in ("raw.bin", "hf", "out.pt", "w3", "dcp.pt", "hf_plain"):
                target = work / out
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
    base_rss = results["python + torch import only"][1]
    gib = info["bytes"] / 2**30

    def work_s(label: str) -> float:
        return max(results[label][0], 1e-6)

    raw_s = work_s("raw copy of the bytes (fsync)")
    dcp_s = work_s("dcp_to_torch_save (+ fsync)")
    print(
        f"\n{'operation':<50} {'seconds':>7} {'GiB/s':>6} {'vs raw':>7} {'vs dcp_to_torch':>15} "
        f"{'peak RSS':>9} {'- import':>9} {'/largest':>8}"
    )
    for label, (_seconds, rss) in results.items():
        if label.startswith("python"):
            print(f"{label:<50} {'':>7} {'':>6} {'':>7} {'':>15} {rss / 2**20:7.0f}Mi")
            continue
        w = work_s(label)
        extra = max(rss - base_rss, 0) if not label.startswith("raw") else rss
        print(
            f"{label:<50} {w:7.2f} {gib / w:6.2f} {raw_s / w:6.2f}x {dcp_s / w:14.2f}x "
            f"{rss / 2**20:7.0f}Mi {extra / 2**20:7.0f}Mi {extra / info['largest']:7.2f}x"
        )
    print(
        f"\nseconds: fastest of {args.repeat} rounds, timed inside each process after its imports; "
        f"'vs raw' = raw-copy time / this time (1.0 = as fast as copying the bytes); 'vs dcp_to_torch' = its "
        f"time / this time; '- import' = peak RSS minus the bare `import torch, checkpoint.tool.cli` process "
        f"({base_rss / 2**20:.0f} MiB); '/largest' = that excess over the largest tensor. "
        f"Checkpoint {info['bytes'] / 2**20:.0f} MiB, largest tensor {info['largest'] / 2**20:.0f} MiB."
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
