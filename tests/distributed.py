"""The one place tests launch ranks: N processes over gloo on CPU.

Usage::

    def _body(rank: int, world_size: int, tmp: str) -> dict:   # module level: it is pickled
        ...
        return {"loss": 1.0}                                     # any picklable value

    results = run_ranks(_body, world_size=3, args=(str(tmp_path),))   # list, one per rank

A failure on any rank is re-raised in the test with that rank's traceback.
Keeping launch details here means a torch API change is a one-file fix.

Ranks are forked from one server process that has imported torch and this project once
(multiprocessing's ``forkserver`` with a preload list), so a test pays for that import once
per session instead of once per rank per test (3-15 s each on a loaded 2-core machine), while
every rank is still a fresh process: nothing one test does to a rank's globals reaches the next.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROCESSES", "CollectiveCount", "RankFailed", "count_collectives", "run_process", "run_ranks"]

DEFAULT_TIMEOUT_S = 180.0
_POLL_S = 0.5

# Imported once by the fork server. A fork copies only the forking thread; the one other thread
# these imports start is numpy's OpenBLAS pool, which OpenBLAS stops around a fork (pthread_atfork).
# s3fs (skipped where not installed) starts no thread on import; it saves each s3 saver ~1 s of imports.
# torch._dynamo (no thread either): fully_shard imports it on first use (DTensor's from_local), ~1.3 s of
# CPU per rank on an idle core; preloaded, a 3-rank FSDP2 launch took 4 s instead of 10 s on the loaded VM.
_PRELOAD = [
    *("torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo"),
    *("checkpoint", "offload_fsdp", "optim", "s3fs"),
]
PROCESSES = multiprocessing.get_context("forkserver")
"""The context every test starts a helper process with (ranks here; other tests' racers too)."""
PROCESSES.set_forkserver_preload(_PRELOAD)


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _rank_main(
    rank: int, world_size: int, store: str, caller: tuple[dict[str, str], str], fn: Callable, args: tuple, queue
) -> None:
    import torch
    import torch.distributed as dist

    # A forked rank starts with the fork server's environment and directory: take the caller's
    # as they are now, as a spawned process would (a test's monkeypatch.setenv / chdir included).
    environ, cwd = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Each rank gets one core's worth of threads: 4 ranks on 2 cores with
    # default threading oversubscribe badly and turn seconds into minutes.
    torch.set_num_threads(1)
    try:
        # A file store, not a TCP one: a port picked free here could be taken (by any process on
        # the machine) before rank 0 binds it; a fresh file in a fresh directory cannot.
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        # Gloo connects the ranks pairwise; a rank whose fn needs no collective could return and close
        # its sockets while a peer is still completing the handshake ("Connection closed by peer").
        dist.barrier()
        result = fn(rank, world_size, *args)
        # Plain pickle, by value: torch's queue would send tensors as shared-memory
        # handles, which die with this process if it exits before the parent reads them.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes over gloo.

    ``fn`` must be defined at module level (it is pickled by reference). Returns
    the per-rank return values in rank order.
    """
    ctx = PROCESSES
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="run_ranks-")
    store = os.path.join(store_dir, "store")
    caller = (dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, store, caller, fn, args, queue), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not failures:
            try:
                rank, ok, payload = queue.get(timeout=_POLL_S)
            except queue_mod.Empty:
                # A rank that died before reporting (killed, or crashed while importing)
                # never puts anything: notice it now instead of waiting out the timeout.
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RankFailed(
                        f"ranks {dead} exited (codes {[procs[i].exitcode for i in dead]}) without reporting"
                    ) from None
                if time.monotonic() > deadline:
                    raise RankFailed(
                        f"ranks did not all report within {timeout_s:.0f}s (reported: {sorted(results)})"
                    ) from None
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")  # the others may be stuck in a collective now
                reported.add(rank)
        # A rank that died silently is often the cause of another's reported failure
        # (a peer's connection reset): name it too, before the survivors are killed below.
        dead = [
            i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results and i not in reported
        ]
        if failures and dead:
            failures.append(
                f"--- ranks {dead} exited (codes {[procs[i].exitcode for i in dead]}) without reporting ---"
            )
    finally:
        complete = len(results) == world_size  # else a failure or a dead rank: the survivors may wait forever
        for p in procs:
            p.join(timeout=5 if complete else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    if failures:
        raise RankFailed("\n".join(failures))
    return [results[r] for r in range(world_size)]


def run_process(target: Callable[..., Any], args: tuple, what: str, timeout_s: float = 120.0) -> int:
    """Run ``target(*args)`` in a new process of :data:`PROCESSES` and wait for it to end: its exit code (``-N``: ended
    by signal N). One still running after ``timeout_s`` is killed, and the test fails saying ``what`` hung."""
    proc = PROCESSES.Process(target=target, args=args)
    proc.start()
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"{what} hung (still running after {timeout_s:.0f} s)")
    assert proc.exitcode is not None
    return proc.exitcode


_OBJECT_PAYLOAD = {  # where each object collective takes what this rank sends: (position, keyword)
    "all_gather_object": (1, "obj"),
    "gather_object": (0, "obj"),
    "broadcast_object_list": (0, "object_list"),
    "scatter_object_list": (1, "scatter_object_input_list"),
}
_TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "barrier",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "send",
    "recv",
    "monitored_barrier",
)


@dataclass
class CollectiveCount:
    calls: Counter = field(default_factory=Counter)
    """calls per torch.distributed function"""
    sent: int = 0
    """pickled bytes this rank handed the object collectives"""


def count_collectives(fn: Callable[[], Any]) -> CollectiveCount:
    """Calls to torch.distributed's collectives while ``fn`` runs, through the public functions
    (patched only here, restored after), and the bytes this rank hands the object collectives."""
    import torch.distributed as dist

    count = CollectiveCount()
    names = (*_OBJECT_PAYLOAD, *_TENSOR_COLLECTIVES)
    originals = {name: getattr(dist, name) for name in names}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            count.calls[name] += 1
            if name in _OBJECT_PAYLOAD:
                position, keyword = _OBJECT_PAYLOAD[name]
                count.sent += len(pickle.dumps(args[position] if len(args) > position else kwargs.get(keyword)))
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return count
