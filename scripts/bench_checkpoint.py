"""Benchmark the fsdp_dtensor checkpoint format: ratios measured in one run, on one file system.

    python scripts/bench_checkpoint.py                          # 256 MiB state, merge sim at 1,024 ranks
    python scripts/bench_checkpoint.py --mib 1024 --dir /nvme/tmp --merge-ranks 1024 8192

Parts (``--parts`` picks a subset):

* ``throughput``: one process saves / loads a state of ``--mib`` MiB (8 tensors
  plus small ones). Bars: a raw sequential write + fsync of the same bytes to
  one file, and a cold read of it; and plain ``dcp.save`` / ``dcp.load`` of the
  same state. "Cold": every file is dropped from the page cache with
  ``posix_fadvise(DONTNEED)`` after it is written (no root needed).
* ``async``: how long an async save blocks the caller, with a whole
  snapshot and with ``max_staging_bytes`` of 64 MiB and 0, vs a blocking save.
* ``staging``: how long the 2nd..Nth of ``--saves`` consecutive async saves
  block the caller when they reuse the staging buffers of the save before
  (the default) vs with fresh buffers each time (``reuse_staging_buffers=False``),
  for a whole snapshot and for ``max_staging_bytes`` of 64 MiB. Device tensors
  (pinned staging) when CUDA is available, else host tensors.
* ``collectives``: calls to torch.distributed collectives per save on 2 gloo
  ranks for 8 / 64 / 512 tensors: ours (collective and scale mode) and a
  per-tensor metadata ``all_gather_object`` (what Megatron-LM's flat-buffer
  checkpointing does today).
* ``ranks``: save wall time of the same global state at 1, 2 and 4 ranks (2 cores here).
* ``scaling``: save / load time (wall and process CPU) and bytes per parameter for the same
  ``--scaling-mib`` MiB of fp32 parameters cut into 100, 1,000, 10,000 and 30,000
  (``--scaling-params``), AdamW over ``named_parameters()``, plain and wrapped by
  ``HybridDeviceOptimizer`` (``--scaling-optimizers``): ours (``checkpoint.save`` / ``load``) vs plain
  ``get_state_dict`` + ``dcp.save`` / ``dcp.load`` vs a floor writer (one file of concatenated
  bytes, a compact JSON index with CRC-32s computed inline, ``os.writev`` / ``os.preadv`` in
  batches), in interleaved rounds. Then, on 2 gloo ranks, the collective calls and the bytes they
  carry on the first and the second save of one layout.
* ``rank-scaling`` (not in the default set: minutes): an FSDP2 (``fully_shard``) model of
  ``--rank-scaling-params`` fp32 params (``--scaling-mib`` MiB) + AdamW state on each of
  ``--rank-scaling-worlds`` gloo ranks: wall and process CPU per rank of a save and a load, ours
  (first save of the layout apart from later ones) vs plain ``get_state_dict`` + ``dcp.save`` /
  ``dcp.load`` with torch's default options; the coordinator's (rank 0's) CPU against the other ranks',
  and the CPU of all ranks together per param, as the ranks grow.
* ``verify``: ``checkpoint.load_state_dict`` of the ``--mib`` state with the
  default content check (``verify="crc"``: each file's CRC-32 computed as it
  is read) vs without (``verify="sizes"``), cold and warm page cache, as a ratio
  (best, and the median of interleaved rounds' own ratios), with the load average
  and the CPU time of the loading thread and of the CRC helper thread.
* ``replicas``: bytes read from storage per rank (counted through a mounted
  :class:`~checkpoint.storage_backend.Storage`) and wall time of ``checkpoint.load``
  of a ``--replica-mib`` MiB model + AdamW state on 4 gloo ranks, HSDP on a 2x2
  (replicate x shard) mesh: one replica reads, the other receives
  (``read_once_per_replica=True``, the default) vs every rank reading its own
  (``False``); interleaved rounds.
* ``capped``: peak RSS above the loaded-into tensors (``VmHWM`` reset through
  ``/proc/self/clear_refs``, in a fresh subprocess per load) of a load of a
  ``--capped-mib`` MiB fp32 checkpoint into bf16 tensors (every byte goes
  through the reader's buffers), with ``max_read_bytes`` of 64 MiB and with no
  cap, against the bound cap + largest tensor + 256 MiB.
* ``remote``: save / load of the ``--remote-mib`` state to ``s3://`` on a local
  S3-compatible server (``moto_server`` on 127.0.0.1, started here; the test
  extra installs it), vs ``s3fs`` writing / reading the same bytes as one
  object in the same run (interleaved rounds, wall and process CPU time); and
  the peak RSS a save adds (a child process) for a state larger than the
  upload part budget (``checkpoint.fsspec_storage.PART_BYTES``).
* ``tiers``: :class:`checkpoint.TieredCheckpointer` on the demo model (``scripts/demo.py``, FSDP2 +
  ``HybridDeviceOptimizer(offload_fraction=1)``) at 2 and 4 gloo ranks, each rank a node of its own,
  local tier in ``/dev/shm``: how long a save blocks the training loop (local only, local + a replica
  on the next node, durable only) as a fraction of a training step, and until it is committed; and
  restore times from each rank's own copy, with one rank's copies lost (from its peer), and from durable.
* ``merge``: by simulation, no real ranks: the per-rank metadata of R ranks x T
  tensors (each tensor row-sharded over all ranks) built in one process; time
  of our commit merge (+ validation) vs DCP's central planning (dedup + global
  plan + validation) on the SavePlans it would gather, the bytes the
  coordinator receives either way, and the ``.metadata`` size.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import checkpoint  # noqa: E402


def _drop_cache(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _state(total_bytes: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    big = total_bytes // 8 // 4
    cols = 1024
    state = {f"layers.{i}.weight": torch.randn(big // cols, cols) for i in range(8)}
    state.update({f"layers.{i}.bias": torch.randn(cols) for i in range(8)})
    return state


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_throughput(root: Path, mib: int) -> None:
    state = _state(mib << 20)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    blob_path = root / "raw.bin"

    def raw_write():
        with open(blob_path, "wb") as f:
            for t in state.values():
                f.write(memoryview(t.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    def raw_read():
        # Into fresh tensors, like a load does (their first-touch page faults count on both sides).
        with open(blob_path, "rb", buffering=0) as f:
            for t in state.values():
                f.readinto(memoryview(torch.empty_like(t).numpy()).cast("B"))

    results = {}
    for name, save, load, target in (
        ("raw", raw_write, raw_read, blob_path),
        (
            "ours",
            lambda: checkpoint.save_state_dict({"model": state}, root / "ours"),
            lambda: checkpoint.load_state_dict(
                {"model": {k: torch.empty_like(v) for k, v in state.items()}}, root / "ours"
            ),
            root / "ours",
        ),
        (
            "dcp",
            lambda: dcp.save({"model": state}, checkpoint_id=root / "dcp", no_dist=True),
            lambda: dcp.load(
                {"model": {k: torch.empty_like(v) for k, v in state.items()}}, checkpoint_id=root / "dcp", no_dist=True
            ),
            root / "dcp",
        ),
    ):
        saves, loads = [], []
        # Round 0 is a warm-up, not timed: on a VM the first writes into never-touched guest
        # memory (fresh page cache) can take several times longer, whichever system comes first.
        for _ in range(3):
            if target.exists():
                shutil.rmtree(target) if target.is_dir() else target.unlink()
            _drop_cache(root)
            saves.append(_timed(save))
            _drop_cache(target)
            loads.append(_timed(load))
        results[name] = (min(saves[1:]), min(loads[1:]))
    raw_save, raw_load = results["raw"]
    print(
        f"\n== throughput: {nbytes / 2**20:.0f} MiB, one process, best of 2 after a warm-up round, cold reads (fadvise DONTNEED)"
    )
    for name in ("raw", "ours", "dcp"):
        s, ld = results[name]
        print(
            f"{name:5s} save {s:6.2f} s ({nbytes / s / 1e9:5.2f} GB/s, {raw_save / s:4.2f}x raw)   "
            f"load {ld:6.2f} s ({nbytes / ld / 1e9:5.2f} GB/s, {raw_load / ld:4.2f}x raw)"
        )
    print(
        f"ours vs plain dcp: save {results['dcp'][0] / results['ours'][0]:.2f}x faster, "
        f"load {results['dcp'][1] / results['ours'][1]:.2f}x faster"
    )


def bench_verify(root: Path, mib: int, rounds: int = 7) -> None:
    """Load with the streamed CRC-32 check (the default) vs without, same files, interleaved rounds.

    Each round loads both ways, in alternating order; the figures are the best of the rounds and the
    median of each round's own ratio. CPU time is split into the loading thread's (the part a core free for
    the helper cannot hide) and the CRC helper thread's (the rest of the process's; with no free core, as
    under a load average above the core count, the wall ratio follows the process CPU ratio instead).
    """
    state = _state(mib << 20)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    path = root / "verify"
    checkpoint.save_state_dict({"model": state}, path)
    targets = {"model": {k: torch.empty_like(v) for k, v in state.items()}}

    def load(mode: str, cold: bool) -> tuple[float, float, float]:
        if cold:
            _drop_cache(path)
        cpu, own = time.process_time(), time.thread_time()
        wall = _timed(lambda: checkpoint.load_state_dict(targets, path, verify=mode))
        return wall, time.process_time() - cpu, time.thread_time() - own

    print(
        f"\n== verify: load of {nbytes / 2**20:.0f} MiB with CRC-32 checked as it is read (default, {_crc_name()}) "
        f"vs sizes only; {rounds} interleaved rounds after a warm-up, load average {_load_average()}; "
        "wall best / median of per-round ratios; process CPU = loading thread + CRC helper"
    )
    for cold in (True, False):
        load("crc", cold), load("sizes", cold)  # warm-up
        times: dict[str, list[tuple[float, float, float]]] = {"crc": [], "sizes": []}
        for i in range(rounds):
            for mode in ("crc", "sizes") if i % 2 else ("sizes", "crc"):
                times[mode].append(load(mode, cold))
        crc, sizes = min(times["crc"]), min(times["sizes"])
        ratios = sorted(c[0] / s[0] for c, s in zip(times["crc"], times["sizes"]))
        crc_cpu = statistics.median(t[1] for t in times["crc"])
        sizes_cpu = statistics.median(t[1] for t in times["sizes"])
        crc_own = statistics.median(t[2] for t in times["crc"])
        print(
            f"{'cold' if cold else 'warm'}  verify='crc' {crc[0]:6.3f} s ({nbytes / crc[0] / 1e9:5.2f} GB/s)   "
            f"verify='sizes' {sizes[0]:6.3f} s ({nbytes / sizes[0] / 1e9:5.2f} GB/s)   "
            f"ratio {crc[0] / sizes[0]:.2f}x best, {ratios[len(ratios) // 2]:.2f}x median round   "
            f"cpu {crc_cpu:5.3f} s ({crc_own:5.3f} loading thread + {crc_cpu - crc_own:5.3f} helper) vs "
            f"{sizes_cpu:5.3f} s: {crc_cpu / sizes_cpu:.2f}x cpu, {crc_own / sizes_cpu:.2f}x on the loading thread"
        )
    print(f"load average after: {_load_average()}")
    shutil.rmtree(path)


def _load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _crc_name() -> str:
    from checkpoint.content_check import crc32

    return "zlib's CRC-32" if crc32.__module__ == "zlib" else f"CRC-32 from {crc32.__module__}"


def bench_async(root: Path, mib: int) -> None:
    """How long an async save blocks the caller, by staging budget, vs a blocking save of the same state."""
    from checkpoint.async_save import async_save_state_dict

    state = _state(mib << 20)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"\n== async save of {nbytes / 2**20:.0f} MiB (host tensors), best of 2: time the caller is blocked")
    blocking = min(
        _timed(lambda: checkpoint.save_state_dict({"model": state}, root / "sync")) for _ in range(3)
    )  # 1st: warm-up
    print(f"blocking save              {blocking:6.3f} s")
    for budget in (None, 64 << 20, 0):
        blocked, total = [], []
        for _ in range(2):
            shutil.rmtree(root / "async", ignore_errors=True)
            start = time.perf_counter()
            future = async_save_state_dict({"model": state}, root / "async", max_staging_bytes=budget)
            blocked.append(time.perf_counter() - start)
            future.result()
            total.append(time.perf_counter() - start)
        label = "whole snapshot" if budget is None else f"max_staging_bytes={budget >> 20} MiB"
        print(
            f"async, {label:30s} blocked {min(blocked):6.3f} s ({min(blocked) / blocking:4.2f}x the blocking save), "
            f"committed after {min(total):6.3f} s; staging memory <= {nbytes if budget is None else budget} B"
        )


def bench_staging(root: Path, mib: int, saves: int) -> None:
    """Caller-blocking time of consecutive async saves, staging buffers reused vs allocated afresh."""
    from checkpoint.async_save import async_save_state_dict

    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {k: v.to(device) for k, v in _state(mib << 20).items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(
        f"\n== staging buffer reuse: {saves} consecutive async saves of {nbytes / 2**20:.0f} MiB ({device} tensors), "
        f"time the caller is blocked in saves 2..{saves} (mean)"
    )

    def blocked_times(budget: int | None, reuse: bool) -> list[float]:
        checkpoint.release_staging_buffers()
        times = []
        for _ in range(saves):
            shutil.rmtree(root / "staging", ignore_errors=True)
            start = time.perf_counter()
            future = async_save_state_dict(
                {"model": state}, root / "staging", max_staging_bytes=budget, reuse_staging_buffers=reuse
            )
            times.append(time.perf_counter() - start)
            future.result()
            for t in state.values():
                t.add_(1.0)  # training changes the state between saves
        checkpoint.release_staging_buffers()
        return times[1:]  # the 1st save allocates either way

    for budget in (None, 64 << 20):
        fresh = blocked_times(budget, reuse=False)
        reused = blocked_times(budget, reuse=True)
        mean_fresh, mean_reused = sum(fresh) / len(fresh), sum(reused) / len(reused)
        label = "whole snapshot" if budget is None else f"max_staging_bytes={budget >> 20} MiB"
        print(
            f"async, {label:30s} fresh buffers {mean_fresh:6.3f} s, reused {mean_reused:6.3f} s: "
            f"fresh / reused {mean_fresh / mean_reused:5.2f}x"
        )


def _replica_model(seed: int, total_bytes: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    width = 1024
    layers = max(total_bytes // 3 // 4 // (width * width), 1)  # params + 2 AdamW moments
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def _replicas_body(rank: int, world_size: int, root: str, total_bytes: int, rounds: int) -> dict:
    from checkpoint.storage_backend import mount, unmount
    from tests.read_counting import ReadCountingStorage

    model, opt = _replica_model(0, total_bytes)
    path = Path(root) / "replicas"
    checkpoint.save(path, model=model, optimizer=opt)
    out: dict[str, list] = {"shared": [], "plain": []}
    for _ in range(rounds):
        for name, once in (("shared", True), ("plain", False)):
            storage = ReadCountingStorage()
            mount(root, storage)
            try:
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                checkpoint.load(path, model=model, optimizer=opt, read_once_per_replica=once)
                dist.barrier()
                out[name].append((time.perf_counter() - start, time.process_time() - cpu, storage.data_bytes()))
            finally:
                unmount(root)
    return out


def bench_replicas(root: Path, mib: int, rounds: int = 3) -> None:
    from tests.distributed import run_ranks

    results = run_ranks(_replicas_body, 4, args=(str(root), mib << 20, rounds), timeout_s=1800)
    print(
        f"\n== replica load: {mib} MiB model + AdamW state, HSDP 2x2 (replicate x shard), 4 gloo ranks, "
        f"best of {rounds} interleaved rounds"
    )
    print(
        "load                          data bytes read per rank (ranks 0..3)       mean/rank   wall s  cpu s (rank 0)"
    )
    mean = {}
    for name, label in (("shared", "one replica reads (default)"), ("plain", "every rank reads")):
        per_rank = [r[name][0][2] for r in results]
        mean[name] = sum(per_rank) / len(per_rank)
        wall = min(max(r[name][i][0] for r in results) for i in range(rounds))
        cpu = min(results[0][name][i][1] for i in range(rounds))
        print(
            f"{label:29s} {' '.join(f'{b / 2**20:8.1f}M' for b in per_rank)}   {mean[name] / 2**20:8.1f}M"
            f"  {wall:7.2f}  {cpu:6.2f}"
        )
    print(f"bytes read per rank, shared / plain: {mean['shared'] / mean['plain']:.2f}x")


_CAPPED_CHILD = """
import sys, torch
sys.path.insert(0, {root!r})
import checkpoint

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

path, cap = sys.argv[1], None if sys.argv[2] == "none" else int(sys.argv[2])
metadata = checkpoint.open_checkpoint(path).metadata.state_dict_metadata
targets = {{k.split(".", 1)[1]: torch.zeros(tuple(m.size), dtype=torch.bfloat16) for k, m in metadata.items()}}
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM (peak RSS) to the current RSS
base = kib("VmRSS")
report = checkpoint.load_state_dict({{"model": targets}}, path, max_read_bytes=cap)
print(kib("VmHWM") - base, report.peak_read_buffer_bytes)
"""


def bench_capped(root: Path, mib: int) -> None:
    import subprocess

    torch.manual_seed(0)
    rows = (mib << 20) // 8 // 4 // 4096
    path = root / "capped"
    checkpoint.save_state_dict({"model": {f"w{i}": torch.randn(rows, 4096) for i in range(8)}}, path)
    largest = rows * 4096 * 4
    child = _CAPPED_CHILD.format(root=str(ROOT))
    print(
        f"\n== capped load: {mib} MiB fp32 checkpoint (8 tensors of {largest / 2**20:.0f} MiB) into bf16 tensors, "
        "fresh process per load; peak RSS above the loaded-into tensors"
    )
    for cap in (64 << 20, None):
        runs = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", child, str(path), "none" if cap is None else str(cap)],
                capture_output=True,
                text=True,
                check=True,
            )
            peak, buffers = map(int, out.stdout.split())
            runs.append((peak, buffers))
        peak, buffers = max(runs)
        bound = (cap or 0) + largest + (256 << 20)
        label = "no cap" if cap is None else f"max_read_bytes={cap >> 20} MiB"
        print(
            f"{label:24s} peak RSS +{peak / 2**20:7.1f} MiB (reader buffers {buffers / 2**20:6.1f} MiB at most)"
            + (f"; bound cap + largest + 256 MiB = {bound / 2**20:.0f} MiB" if cap is not None else "")
        )
    shutil.rmtree(path)


def _count(fn) -> int:
    from tests.distributed import count_collectives

    return sum(count_collectives(fn).calls.values())


def _collectives_body(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for n in (8, 64, 512):
        state = {
            f"t{i}": checkpoint.shard(torch.full((4, 8), float(i)), (4 * world_size, 8), offsets=(4 * rank, 0))
            for i in range(n)
        }

        def per_tensor_gather():
            for key in state:  # one metadata exchange per tensor
                gathered = [None] * world_size
                dist.all_gather_object(gathered, (key, (4 * rank, 0), (4, 8)))

        out[n] = (
            _count(lambda: checkpoint.save_state_dict(state, Path(root) / f"c{n}")),
            _count(lambda: checkpoint.save_state_dict(state, Path(root) / f"s{n}", mode="scale")),
            _count(per_tensor_gather),
        )
    return out


def bench_collectives(root: Path) -> None:
    from tests.distributed import run_ranks

    result = run_ranks(_collectives_body, 2, args=(str(root),))[0]
    print("\n== collectives per save, 2 gloo ranks (calls into torch.distributed)")
    print("tensors  ours(collective)  ours(scale)  per-tensor metadata gather")
    for n, (ours, scale, gather) in result.items():
        print(f"{n:7d}  {ours:16d}  {scale:11d}  {gather:26d}")


def _ranks_body(rank: int, world_size: int, root: str, total_bytes: int) -> float:
    rows_total = total_bytes // 4 // 1024 // 8
    lo, hi = rank * rows_total // world_size, (rank + 1) * rows_total // world_size
    state = {
        f"w{i}": checkpoint.shard(torch.randn(hi - lo, 1024), (rows_total, 1024), offsets=(lo, 0)) for i in range(8)
    }
    dist.barrier()
    start = time.perf_counter()
    checkpoint.save_state_dict(state, Path(root) / f"r{world_size}")
    elapsed = time.perf_counter() - start
    return elapsed


def bench_ranks(root: Path, mib: int) -> None:
    from tests.distributed import run_ranks

    print(f"\n== save wall time of one {mib} MiB state at 1 / 2 / 4 ranks (gloo, {os.cpu_count()} cores)")
    base = None
    for world_size in (1, 2, 4):
        elapsed = max(run_ranks(_ranks_body, world_size, args=(str(root), mib << 20)))
        base = base or elapsed
        print(f"{world_size} rank(s): {elapsed:6.2f} s  ({base / elapsed:4.2f}x the 1-rank speed)")


def _simulated_ranks(ranks: int, tensors: int):
    """Per rank: what DCP's coordinator gathers (SavePlan, then WriteResults) and our scale-mode record.

    The write items are exactly what :class:`checkpoint.CheckpointShard` makes for a
    row block (one row of a ``(ranks, 16)`` fp32 tensor per rank), built directly
    to keep the simulation itself fast.
    """
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    from checkpoint.manifest import FileRecord
    from checkpoint.storage import rank_record

    properties = TensorProperties(dtype=torch.float32)
    size = torch.Size((ranks, 16))
    sizes = torch.Size((1, 16))
    for rank in range(ranks):
        offsets = torch.Size((rank, 0))
        items = [
            WriteItem(
                index=MetadataIndex(f"model.layers.{t}.weight", offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), properties, size),
            )
            for t in range(tensors)
        ]
        plan = SavePlan(items)
        _, local_md = create_default_global_save_plan([plan], rewrite_index_hints=False)
        name = f"__{rank}_0.distcp"
        results = [
            WriteResult(index=item.index, size_in_bytes=1100, storage_data=_StorageInfo(name, i * 1200, 1100))
            for i, item in enumerate(items)
        ]
        record = rank_record(local_md, results, {name: FileRecord(size=1200 * tensors, crc32=0)})
        yield pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL), pickle.dumps(results), json.dumps(record)


def _pickled_size(metadata) -> str:
    """``.metadata``'s size as DCP pickles it, or why it could not be measured here."""
    try:
        return f"{len(pickle.dumps(metadata)) / 2**20:6.1f} MiB"
    except MemoryError:  # 8,192 ranks x 1,000 tensors: the pickle alone outgrows a 24 GiB host
        return "too large to pickle on this host"


def bench_merge(ranks_list: list[int], tensors: int, *, with_dcp: bool = True) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from checkpoint.commit import merge_metadata
    from checkpoint.planner import metadata_problems

    print(f"\n== metadata at scale, simulated ({tensors} tensors, each row-sharded over all ranks)")
    print("times start from the bytes rank 0 receives (R rank records / R gathered SavePlans + WriteResults)")
    print("ranks | ours: merge+validate  receives | DCP central: plan+validate+results  receives | .metadata")
    for ranks in ranks_list:
        plans, results, records = [], [], []
        for plan, result, record in _simulated_ranks(ranks, tensors):
            if with_dcp:
                plans.append(plan)
                results.append(result)
            records.append(record)
        ours_bytes = sum(len(r) for r in records)
        dcp_bytes = sum(len(p) for p in plans) + sum(len(r) for r in results)
        start = time.perf_counter()
        merged, _ = merge_metadata([json.loads(r) for r in records])
        problems = metadata_problems(merged)
        ours_t = time.perf_counter() - start
        assert not problems, problems[:3]
        del records
        metadata_size = _pickled_size(merged)
        del merged
        if not with_dcp:
            print(
                f"{ranks:5d} | {ours_t:8.2f} s  {ours_bytes / 2**20:11.1f} MiB | (not run)  | {metadata_size}",
                flush=True,
            )
            continue
        planner = DefaultSavePlanner()
        planner.flatten_state_dict = False
        start = time.perf_counter()
        _, metadata = planner._create_global_plan([pickle.loads(p) for p in plans])  # dedup, plan, validate
        storage = {}
        for blob in results:  # what the final gather brings back: where every chunk was stored
            storage.update({wr.index: wr.storage_data for wr in pickle.loads(blob)})
        metadata.storage_data = storage
        dcp_t = time.perf_counter() - start
        del plans, results, planner, metadata, storage
        print(
            f"{ranks:5d} | {ours_t:8.2f} s  {ours_bytes / 2**20:11.1f} MiB | "
            f"{dcp_t:8.2f} s  {dcp_bytes / 2**20:25.1f} MiB | {metadata_size}"
        )
        print(
            f"        ours / DCP time: {ours_t / dcp_t:4.2f}x; DCP also scatters a plan back to every rank, ours sends nothing"
        )


def _params_model(
    count: int, total_bytes: int, optimizer: str = "adamw"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``count`` fp32 parameters of equal size, AdamW over ``named_parameters()`` with its state created
    (``optimizer="hybrid"``: the same AdamW wrapped by ``HybridDeviceOptimizer``)."""
    torch.manual_seed(0)
    model = torch.nn.ParameterDict(
        {f"p{i}": torch.nn.Parameter(torch.randn(max(total_bytes // 4 // count, 1))) for i in range(count)}
    )
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-3, foreach=True)
    if optimizer == "hybrid":
        from offload_fsdp import HybridDeviceOptimizer

        opt = HybridDeviceOptimizer(opt, offload_fraction=1.0, model=model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _ours_save(model, opt, path) -> None:
    checkpoint.save(path, model=model, optimizer=opt)


def _ours_load(model, opt, path) -> None:
    checkpoint.load(path, model=model, optimizer=opt)


def _dcp_save(model, opt, path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path, no_dist=True)


def _dcp_load(model, opt, path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path, no_dist=True)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def _floor_tensors(model, opt) -> dict[str, torch.Tensor]:
    """The same tensors a save writes (params and optimizer state, by name), with no format around them."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer.{names[id(p)]}.{k}"] = v
    return out


_FLOOR_BATCH = 512  # iovecs per system call (IOV_MAX is 1024 on Linux)


def _floor_save(model, opt, path) -> None:
    """The floor: one file of concatenated bytes + a compact JSON index (CRC-32 inline), ``os.writev`` in batches."""
    import zlib

    path.mkdir(parents=True)
    index, views, offset = {}, [], 0
    for key, t in _floor_tensors(model, opt).items():
        view = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        index[key] = [str(t.dtype), list(t.shape), offset, len(view), zlib.crc32(view)]
        views.append(view)
        offset += len(view)
    fd = os.open(path / "data", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(views), _FLOOR_BATCH):
            batch = views[i : i + _FLOOR_BATCH]
            want, done = sum(len(v) for v in batch), os.writev(fd, batch)
            assert done == want, "short writev"
        os.fsync(fd)
    finally:
        os.close(fd)
    (path / "index.json").write_text(json.dumps(index, separators=(",", ":")))


def _floor_load(model, opt, path) -> None:
    """The floor's load: the index, then ``os.preadv`` straight into the tensors in batches, CRC-32 checked."""
    import zlib

    index = json.loads((path / "index.json").read_text())
    tensors = _floor_tensors(model, opt)
    fd = os.open(path / "data", os.O_RDONLY)
    try:
        keys = list(index)
        for i in range(0, len(keys), _FLOOR_BATCH):
            batch = keys[i : i + _FLOOR_BATCH]
            views = [memoryview(tensors[k].reshape(-1).view(torch.uint8).numpy()) for k in batch]
            assert os.preadv(fd, views, index[batch[0]][2]) == sum(len(v) for v in views), "short preadv"
            for k, v in zip(batch, views):
                assert zlib.crc32(v) == index[k][4], f"{k}: CRC-32 mismatch"
    finally:
        os.close(fd)


def _timed_cpu(fn) -> tuple[float, float]:
    """(wall, process CPU) seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


_WRITERS = {
    "ours": (_ours_save, _ours_load),
    "dcp": (_dcp_save, _dcp_load),
    "floor": (_floor_save, _floor_load),
}


def bench_scaling(root: Path, mib: int, counts: list[int], rounds: int, optimizers: list[str]) -> None:
    """Per-parameter save / load cost as the same bytes are cut into more parameters (model + AdamW state).

    Rounds interleave the writers (ours, plain DCP, the floor), so a machine busy with other work slows
    them alike; each figure is the best round, wall and process CPU time.
    """
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    print(
        f"\n== scaling: {mib} MiB of fp32 params + AdamW state, one process, best of {rounds} interleaved rounds"
        f" (load: {os.getloadavg()[0]:.1f})"
    )
    print(
        f"{'optimizer':9s} {'params':>6s} {'who':5s} {'save us/p':>9s} {'cpu':>6s} {'load us/p':>9s} {'cpu':>6s}"
        f" {'bytes/p':>8s} {'save/dcp':>8s} {'load/dcp':>8s} {'save/floor':>10s} {'load/floor':>10s}"
        f" {'load/dcp cpu':>12s} {'load/floor cpu':>14s}"
    )
    for optimizer in optimizers:
        for count in counts:
            model, opt = _params_model(count, mib << 20, optimizer)
            best: dict[str, list] = {who: [None, None, None, None, 0] for who in _WRITERS}
            for round_ in range(rounds):
                for who, (save, load) in _WRITERS.items():
                    path = root / f"scale_{who}_{count}_{round_}"
                    saved = _timed_cpu(partial(save, model, opt, path))
                    loaded = _timed_cpu(partial(load, model, opt, path))
                    entry = best[who]
                    for slot, value in ((0, saved[0]), (1, saved[1]), (2, loaded[0]), (3, loaded[1])):
                        entry[slot] = value if entry[slot] is None else min(entry[slot], value)
                    entry[4] = _dir_bytes(path)
                    shutil.rmtree(path, ignore_errors=True)
            dcp_, floor = best["dcp"], best["floor"]
            for who, (sw, sc, lw, lc, size) in best.items():
                per = 1e6 / count
                print(
                    f"{optimizer:9s} {count:6d} {who:5s} {sw * per:9.0f} {sc * per:6.0f} {lw * per:9.0f} {lc * per:6.0f}"
                    f" {size / count:8.0f} {sw / dcp_[0]:8.2f} {lw / dcp_[2]:8.2f} {sw / floor[0]:10.2f} {lw / floor[2]:10.2f}"
                    f" {lc / dcp_[3]:12.2f} {lc / floor[3]:14.2f}"  # process CPU: the figure this shared VM's load spares
                )
            del model, opt


def _plan_collectives_body(rank: int, world_size: int, root: str, count: int) -> dict:
    """Calls into torch.distributed and the bytes they carry, on the first and the second save of a layout."""
    state = {
        f"t{i}": checkpoint.shard(torch.full((4, 8), float(i)), (4 * world_size, 8), offsets=(4 * rank, 0))
        for i in range(count)
    }
    return {
        which: _count_with_bytes(
            lambda which=which: checkpoint.save_state_dict(state, Path(root) / f"p{count}_{which}")
        )
        for which in ("first", "second")
    }


def _count_with_bytes(fn) -> tuple[int, int]:
    """(calls, pickled bytes sent by this rank) of the collectives while ``fn`` runs."""
    from tests.distributed import count_collectives

    count = count_collectives(fn)
    return sum(count.calls.values()), count.sent


def bench_plan_collectives(root: Path, counts: list[int]) -> None:
    from tests.distributed import run_ranks

    print("\n== collectives of a save on 2 gloo ranks, first vs second save of a layout (calls, bytes rank 1 sends)")
    print(f"{'tensors':>7s} {'first':>16s} {'second':>16s}")
    for count in counts:
        result = run_ranks(_plan_collectives_body, 2, args=(str(root), count))[1]
        (c1, b1), (c2, b2) = result["first"], result["second"]
        print(f"{count:7d} {c1:5d} {b1:10d} {c2:5d} {b2:10d}")


def _rank_scaling_body(rank: int, world_size: int, root: str, count: int, total_bytes: int, rounds: int) -> dict:
    """One rank of an FSDP2 model of ``count`` fp32 params + AdamW state: (wall, process CPU) of each save and
    load, ours and plain DCP's, in interleaved rounds; ours' first save of the layout apart from later ones."""
    import warnings

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = torch.nn.ParameterDict(
        {f"p{i}": torch.nn.Parameter(torch.randn(max(total_bytes // 4 // count, 1))) for i in range(count)}
    )
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    # foreach over thousands of DTensors spent minutes in DTensor's sharding propagation at 2 ranks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()

    def dcp_save(path: Path) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)

    def dcp_load(path: Path) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    systems = {
        "ours": (lambda path: checkpoint.save(path, model=model, optimizer=opt),
                 lambda path: checkpoint.load(path, model=model, optimizer=opt)),
        "dcp": (dcp_save, dcp_load),
    }  # fmt: skip

    def timed(fn) -> tuple[float, float]:
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    out: dict[str, list] = {f"{who}_{op}": [] for who in systems for op in ("save", "load")}
    for round_ in range(rounds):
        for who, (save, load) in systems.items():
            path = Path(root) / f"rs_{who}_{world_size}_{count}_{round_}"
            out[f"{who}_save"].append(timed(lambda: save(path)))
            out[f"{who}_load"].append(timed(lambda: load(path)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    return out


def bench_rank_scaling(root: Path, mib: int, count: int, worlds: list[int], rounds: int) -> None:
    """Save / load cost of one FSDP2 model + AdamW state as the ranks sharing it grow: per rank and on the
    coordinator (rank 0), ours vs plain DCP (``get_state_dict`` + ``dcp.save`` / ``dcp.load``, torch's
    default options), process CPU per rank in one run."""
    from tests.distributed import run_ranks

    print(
        f"\n== rank scaling: FSDP2 (fully_shard) model of {count:,} fp32 params ({mib} MiB) + AdamW state on"
        f" {' / '.join(map(str, worlds))} gloo ranks ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f});"
        f" {rounds} interleaved rounds; ours' first save of the layout apart, later figures the best round"
    )
    print(
        f"{'ranks':>5s} {'who':5s} {'op':12s} {'wall s':>7s} {'cpu/rank s':>10s} {'rank0 cpu':>9s}"
        f" {'others cpu':>10s} {'rank0/others':>12s} {'cpu us/param':>12s} {'ours/dcp cpu':>12s}"
    )
    for world_size in worlds:
        per_rank = run_ranks(_rank_scaling_body, world_size, args=(str(root), count, mib << 20, rounds), timeout_s=3600)
        rows: dict[tuple[str, str], tuple[float, list[float]]] = {}
        for who in ("ours", "dcp"):
            for op in ("save", "load"):
                runs = [r[f"{who}_{op}"] for r in per_rank]  # [rank][round] -> (wall, cpu)
                picks = [("first save", [0])] if who == "ours" and op == "save" else []
                later = list(range(1, rounds)) if who == "ours" and op == "save" and rounds > 1 else range(rounds)
                picks.append((op if not picks else "later save", list(later)))
                for label, which in picks:
                    best = min(which, key=lambda i: max(r[i][1] for r in runs))
                    rows[(who, label)] = (max(r[best][0] for r in runs), [r[best][1] for r in runs])
        for (who, label), (wall, cpus) in rows.items():
            others = cpus[1:] or cpus
            mean_cpu = sum(cpus) / len(cpus)
            base = rows.get(("dcp", "save" if "save" in label else "load"))
            ratio = f"{mean_cpu / (sum(base[1]) / len(base[1])):12.2f}" if who == "ours" and base else f"{'':12s}"
            print(
                f"{world_size:5d} {who:5s} {label:12s} {wall:7.2f} {mean_cpu:10.2f} {cpus[0]:9.2f}"
                f" {sum(others) / len(others):10.2f} {cpus[0] / (sum(others) / len(others)):12.2f}"
                f" {sum(cpus) / count * 1e6:12.0f} {ratio}"
            )


_RSS_CHILD = """
import sys, threading, time, torch, checkpoint
sys.path.insert(0, sys.argv[3])
from scripts.bench_checkpoint import _state
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
state = _state(int(sys.argv[2]) << 20)
# a small save first: the storage's libraries (s3fs, botocore's service models) are loaded before the baseline
checkpoint.save_state_dict({"w": torch.ones(4)}, sys.argv[1] + "-warm-up")
before, peak, done = rss(), [0], threading.Event()
def sample():  # the resident set while the save runs, every 2 ms
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
sampler = threading.Thread(target=sample)
sampler.start()
checkpoint.save_state_dict({"model": state}, sys.argv[1])
done.set()
sampler.join()
print(before, peak[0])
"""


def bench_remote(mib: int, rounds: int = 5) -> None:
    import subprocess
    import sys

    import fsspec

    from checkpoint.fsspec_storage import PART_BYTES, UPLOAD_PARTS
    from tests.s3_server import MotoServer, environment, make_bucket

    server = MotoServer()
    try:
        os.environ.update(environment(server.endpoint))
        bucket = make_bucket(server.endpoint)
        state = _state(mib << 20)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        fs = fsspec.filesystem("s3", endpoint_url=server.endpoint, use_listings_cache=False, skip_instance_cache=True)

        def s3fs_put(key: str) -> None:
            with fs.open(f"{bucket}/{key}", "wb", block_size=PART_BYTES) as f:
                for t in state.values():
                    f.write(memoryview(t.numpy()).cast("B"))

        def s3fs_get(key: str) -> None:
            with fs.open(f"{bucket}/{key}", "rb", cache_type="none") as f:
                for t in state.values():
                    f.readinto(memoryview(torch.empty_like(t).numpy()).cast("B"))

        def ours_save(key: str) -> None:
            checkpoint.save_state_dict({"model": state}, f"s3://{bucket}/{key}")

        def ours_load(key: str) -> None:
            target = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
            checkpoint.load_state_dict(target, f"s3://{bucket}/{key}")

        times: dict[str, list[tuple[float, float]]] = {}
        for round_ in range(rounds + 1):  # interleaved; round 0 is a warm-up
            for name, fn in (
                ("s3fs put", s3fs_put),
                ("ours save", ours_save),
                ("s3fs get", s3fs_get),
                ("ours load", ours_load),
            ):
                key = f"{name.split()[0]}{round_}"  # a load reads what the save of its round wrote
                wall, cpu = time.perf_counter(), time.process_time()
                fn(key)
                times.setdefault(name, []).append((time.perf_counter() - wall, time.process_time() - cpu))
        print(
            f"\n== remote: {nbytes / 2**20:.0f} MiB to s3:// on moto_server (127.0.0.1), best of {rounds} "
            f"interleaved rounds after a warm-up (load: {os.getloadavg()[0]:.1f})"
        )
        best = {name: min(t[1:]) for name, t in times.items()}
        for name, (wall, cpu) in best.items():
            print(f"{name:10s} {wall:6.2f} s ({nbytes / wall / 2**20:6.1f} MiB/s), process CPU {cpu:6.2f} s")
        print(
            f"ours / s3fs: save {best['s3fs put'][0] / best['ours save'][0]:.2f}x the MB/s, "
            f"load {best['s3fs get'][0] / best['ours load'][0]:.2f}x (best against best)"
        )
        for ours, theirs in (("ours save", "s3fs put"), ("ours load", "s3fs get")):
            # each round's pair ran back to back: the server's load swings between rounds more than within one
            ratios = sorted(t[0] / o[0] for o, t in zip(times[ours][1:], times[theirs][1:]))
            print(
                f"{ours} / {theirs} per round: median {ratios[len(ratios) // 2]:.2f}x, "
                f"lowest {ratios[0]:.2f}x, highest {ratios[-1]:.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"
            )
        repo = str(Path(__file__).resolve().parents[1])
        for who in ("ours",):
            out = subprocess.run(
                [sys.executable, "-c", _RSS_CHILD, f"s3://{bucket}/rss-{who}", str(mib), repo],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": repo},
            ).stdout.split()
            before, after = int(out[-2]), int(out[-1])
            print(
                f"peak RSS while writing the {nbytes / 2**20:.0f} MiB state ({who}): +{(after - before) / 2**20:.0f} MiB "
                f"over the process after a small save (part budget {UPLOAD_PARTS} parts held x {PART_BYTES >> 20} MiB "
                f"= {UPLOAD_PARTS * PART_BYTES >> 20} MiB; {nbytes // PART_BYTES} parts)"
            )
    finally:
        server.stop()


def _tiers_body(rank: int, world_size: int, root: str, local_root: str, rounds: int) -> dict:
    """Demo model, FSDP2 + HybridDeviceOptimizer(offload_fraction=1); each rank a "node" of its own."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import demo

    cfg = demo.Config()
    model, opt, sched = demo.build(cfg, torch.device("cpu"), world_size)
    data = demo.corpus()
    nodes = list(range(world_size))

    def train(step: int) -> float:
        start = time.perf_counter()
        batch = demo.local_batch(demo.global_batch(data, cfg, step), rank, world_size)
        demo.lm_loss(model, batch).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        return time.perf_counter() - start

    def tiers(name: str, **options) -> checkpoint.TieredCheckpointer:
        local = Path(local_root) / name / f"node{rank}"
        return checkpoint.TieredCheckpointer(local, Path(root) / name / "durable", nodes=nodes, **options)

    configs = {
        "local": tiers("local", local_every=1, durable_every=0, replication=0),
        "local+replica": tiers("replica", local_every=1, durable_every=0, replication=1),
        "durable": tiers("durable", local_every=0, durable_every=1),
    }
    out: dict[str, list] = {"step": [], **{f"{n} block": [] for n in configs}, **{f"{n} done": [] for n in configs}}
    step = 0
    for tier in configs.values():  # first saves allocate the staging buffers
        step += 1
        train(step)
        tier.save(step, model=model, optimizer=opt, extra={"sched": sched.state_dict()})
        tier.wait()
    for _ in range(rounds):
        for name, tier in configs.items():
            step += 1
            out["step"].append(train(step))
            dist.barrier()
            start = time.perf_counter()
            tier.save(step, model=model, optimizer=opt, extra={"sched": sched.state_dict()})
            out[f"{name} block"].append(time.perf_counter() - start)
            tier.wait()
            out[f"{name} done"].append(time.perf_counter() - start)
    replica = configs["local+replica"]
    for _ in range(rounds):
        for source in ("local", "peer", "durable"):
            if source == "peer" and rank == world_size - 1:
                shutil.rmtree(Path(local_root) / "replica" / f"node{rank}" / f"rank{rank}")  # this node lost its own
            dist.barrier()
            start = time.perf_counter()
            restored = (configs["durable"] if source == "durable" else replica).restore(model=model, optimizer=opt)
            out.setdefault(f"restore {source}", []).append(time.perf_counter() - start)
            assert restored is not None and restored.source == source, (source, restored)
    return out


def bench_tiers(root: Path, rounds: int = 3) -> None:
    from statistics import median

    from tests.distributed import run_ranks

    local_root = Path(tempfile.mkdtemp(prefix="bench_tiers_", dir="/dev/shm" if os.path.isdir("/dev/shm") else root))
    try:
        for world_size in (2, 4):
            load = os.getloadavg()[0]
            results = run_ranks(
                _tiers_body,
                world_size,
                args=(str(root / f"tiers{world_size}"), str(local_root / str(world_size)), rounds),
                timeout_s=1800,
            )
            worst = {k: [max(r[k][i] for r in results) for i in range(rounds)] for k in results[0]}
            step = median(worst["step"])
            print(
                f"\n== tiers: demo model (scripts/demo.py Config()), FSDP2 + HybridDeviceOptimizer(offload_fraction=1), "
                f"{world_size} gloo ranks, one node each; local tier {local_root}; medians of {rounds} interleaved "
                f"rounds, slowest rank; load average {load:.1f} at the start"
            )
            print(f"training step: {step:.3f} s")
            print("save            blocks the loop        until committed (background)")
            for name in ("local", "local+replica", "durable"):
                block, done = median(worst[f"{name} block"]), median(worst[f"{name} done"])
                print(f"{name:15s} {block:7.3f} s {block / step:6.2f} step   {done:7.3f} s {done / step:6.2f} step")
            for source in ("local", "peer", "durable"):
                print(f"restore from {source:8s} {median(worst[f'restore {source}']):7.3f} s")
    finally:
        shutil.rmtree(local_root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to write (default: the system temp dir; pass a path on the file system to measure)",
    )
    parser.add_argument("--mib", type=int, default=256, help="state size for throughput (MiB)")
    parser.add_argument("--ranks-mib", type=int, default=64, help="state size for the 1/2/4-rank save times (MiB)")
    parser.add_argument("--merge-ranks", type=int, nargs="+", default=[1024])
    parser.add_argument("--merge-tensors", type=int, default=1000)
    parser.add_argument("--merge-ours-only", action="store_true", help="skip DCP's central plan (memory / time)")
    parser.add_argument("--saves", type=int, default=5, help="consecutive async saves for the staging part (>= 2)")
    parser.add_argument("--replica-mib", type=int, default=48, help="model + AdamW state for the replicas part (MiB)")
    parser.add_argument("--capped-mib", type=int, default=512, help="checkpoint size for the capped part (MiB)")
    parser.add_argument("--remote-mib", type=int, default=128, help="state size for the remote (s3://) part (MiB)")
    parser.add_argument("--remote-rounds", type=int, default=5, help="interleaved rounds of the remote part")
    parser.add_argument("--scaling-mib", type=int, default=16, help="state size for the per-tensor scaling part (MiB)")
    parser.add_argument(
        "--scaling-params",
        type=int,
        nargs="+",
        default=[100, 1000, 10000, 30000],
        help="parameter counts the scaling part cuts that state into",
    )
    parser.add_argument(
        "--rank-scaling-params", type=int, default=3000, help="params of the FSDP2 model of the rank-scaling part"
    )
    parser.add_argument(
        "--rank-scaling-worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes of the rank-scaling part"
    )
    parser.add_argument("--scaling-rounds", type=int, default=2, help="interleaved rounds of the scaling part")
    parser.add_argument("--scaling-optimizers", nargs="+", default=["adamw", "hybrid"], choices=["adamw", "hybrid"])
    parser.add_argument(
        "--parts",
        nargs="+",
        default=[
            "throughput",
            "verify",
            "async",
            "staging",
            "collectives",
            "ranks",
            "replicas",
            "capped",
            "merge",
            "scaling",
        ],
    )
    args = parser.parse_args(argv)
    if args.saves < 2:
        parser.error(f"--saves must be at least 2 (the 1st save allocates either way), got {args.saves}")
    torch.set_num_threads(1)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))  # None: the system temp dir
    try:
        print(f"torch {torch.__version__}, {os.cpu_count()} cores, writing under {root}")
        if "throughput" in args.parts:
            bench_throughput(root, args.mib)
        if "verify" in args.parts:
            bench_verify(root, args.mib)
        if "async" in args.parts:
            bench_async(root, args.mib)
        if "staging" in args.parts:
            bench_staging(root, args.mib, args.saves)
        if "collectives" in args.parts:
            bench_collectives(root)
        if "ranks" in args.parts:
            bench_ranks(root, args.ranks_mib)
        if "replicas" in args.parts:
            bench_replicas(root, args.replica_mib)
        if "capped" in args.parts:
            bench_capped(root, args.capped_mib)
        if "merge" in args.parts:
            bench_merge(args.merge_ranks, args.merge_tensors, with_dcp=not args.merge_ours_only)
        if "scaling" in args.parts:
            bench_scaling(root, args.scaling_mib, args.scaling_params, args.scaling_rounds, args.scaling_optimizers)
            bench_plan_collectives(root, [c for c in args.scaling_params if c <= 1000] or [100])
        if "rank-scaling" in args.parts:
            bench_rank_scaling(
                root, args.scaling_mib, args.rank_scaling_params, args.rank_scaling_worlds, args.scaling_rounds
            )
        if "remote" in args.parts:
            bench_remote(args.remote_mib, args.remote_rounds)
        if "tiers" in args.parts:
            bench_tiers(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
