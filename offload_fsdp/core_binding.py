"""The host step's threads bound to this local rank's own cores (``OffloadOptions.bind_host_cores``).

On a node shared by several ranks, the host step of each rank (the thread running
it and the threads it fans out to: torch's OpenMP team, the compiled loop's
pthreads) would otherwise float over every core of the node, and the ranks'
memory-bandwidth-bound updates evict each other's caches and cross NUMA nodes.
With binding, the cores this process may use (``os.sched_getaffinity``) are split
into ``LOCAL_WORLD_SIZE`` disjoint sets and local rank ``LOCAL_RANK`` takes one
(:func:`cores_for_rank`): whole NUMA nodes' cores per rank where the node count
divides the rank count (``/sys/devices/system/node``), else consecutive runs of the
node-ordered core list.

What is bound: one thread per optimizer that runs every host bucket's update
``step()`` makes (:class:`HostCores`), and the overlapped mode's host worker
(``HostWorker``, bound as it starts). Each is bound when it starts, before it
creates any thread of its own, and Linux gives a new thread its creator's mask, so
the OpenMP team and pthreads of the step inherit the binding. The user's thread
(the training loop) and everything else in the process keep their affinity.

The rule (``bind_host_cores``):

* ``None`` (default): nothing is bound. Binding is opt-in: on the one many-core host it
  was measured on (16 cores, one NUMA node, no SMT siblings; docs/offload.md, "Core
  binding") a bound host step at two local ranks took 5.5x the time and 4.7x the CPU
  time of an unbound one (cause not established). ``None`` stays apart from ``False``
  so that binding can become automatic where it is measured to gain.
* ``True``: bind, splitting whatever mask the process has (a restricted one
  included) among the local ranks; fewer allowed cores than local ranks is a
  ``ValueError`` (each rank needs at least one core of its own).
* ``False``: never bind.

The outcome (cores chosen, or why none) is in the optimizer's INFO construction line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

__all__ = ["HostCores", "cores_for_rank", "format_cores", "numa_nodes", "parse_cpulist"]

NODE_ROOT = Path("/sys/devices/system/node")

T = TypeVar("T")


def parse_cpulist(text: str) -> frozenset[int]:
    """The cores of a Linux cpulist (``"0-3,8,10-11"``; empty for an empty list)."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return frozenset(cores)


def format_cores(cores: Iterable[int]) -> str:
    """``cores`` as a cpulist (``"0-3,8"``), the form ``taskset -c`` and ``/sys`` use."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def numa_nodes(root: Path = NODE_ROOT) -> list[frozenset[int]]:
    """The cores of each NUMA node, in node order; ``[]`` where the kernel does not say (not Linux, no sysfs)."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cores = parse_cpulist((path / "cpulist").read_text())
        except (OSError, ValueError):
            return []  # an unreadable topology is an unknown one
        if cores:  # memory-only nodes have no cores
            nodes.append(cores)
    return nodes


def cores_for_rank(
    allowed: frozenset[int], nodes: list[frozenset[int]], local_rank: int, local_world_size: int
) -> frozenset[int]:
    """Local rank ``local_rank``'s share of ``allowed``: disjoint from every other local rank's, together all of it.

    NUMA-local: when the nodes holding allowed cores can each take the same number of ranks
    (``local_world_size`` a multiple of their count, each with a core per rank), every rank's share
    lies in one node; otherwise the node-ordered core list is cut into consecutive runs of
    near-equal length. Raises ``ValueError`` when there are fewer allowed cores than local ranks.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} is not in [0, LOCAL_WORLD_SIZE={local_world_size})")
    if len(allowed) < local_world_size:
        raise ValueError(
            f"bind_host_cores=True: {len(allowed)} allowed cores ({format_cores(allowed)}) cannot give each of "
            f"{local_world_size} local ranks a core of its own; run fewer ranks per node, allow more cores, or "
            "pass bind_host_cores=False"
        )
    in_nodes = [sorted(node & allowed) for node in nodes if node & allowed]
    outside = sorted(allowed - frozenset().union(*nodes))
    if in_nodes and not outside and local_world_size % len(in_nodes) == 0:
        per_node = local_world_size // len(in_nodes)
        node = in_nodes[local_rank // per_node]
        if len(node) >= per_node:
            return _run_of(node, local_rank % per_node, per_node)
    ordered = [core for node in in_nodes for core in node] + outside
    return _run_of(ordered, local_rank, local_world_size)


def _run_of(cores: list[int], index: int, count: int) -> frozenset[int]:
    """The ``index``-th of ``count`` consecutive, near-equal runs of ``cores``."""
    n = len(cores)
    return frozenset(cores[index * n // count : (index + 1) * n // count])


def _local_ranks() -> tuple[int, int]:
    """(``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) as torchrun sets them; (0, 1) outside a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _choose(setting: bool | None) -> tuple[frozenset[int] | None, str]:
    """(cores to bind to, or None; the reason, for the INFO line) for ``bind_host_cores=setting``."""
    if not setting:
        why = "bind_host_cores=False" if setting is False else "bind_host_cores=None: binding is opt-in, pass True"
        return None, f"not bound ({why})"
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("bind_host_cores=True needs os.sched_setaffinity (Linux); pass bind_host_cores=None")
    allowed = frozenset(os.sched_getaffinity(0))
    local_rank, local_world_size = _local_ranks()
    cores = cores_for_rank(allowed, numa_nodes(), local_rank, local_world_size)
    return cores, f"{format_cores(cores)} (local rank {local_rank} of {local_world_size})"


class HostCores:
    """This rank's host-step cores (or none) and the one bound thread that runs ``step()``'s host updates.

    ``setting``: ``OffloadOptions.bind_host_cores``; chosen at construction by the module's rule.
    """

    def __init__(self, setting: bool | None) -> None:
        self.cores, self.description = _choose(setting)
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0

    def bind_this_thread(self) -> None:
        """Bind the calling thread (and every thread it creates from now on) to :attr:`cores`; no-op if unbound."""
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)  # 0: the calling thread only (Linux sets masks per thread)

    def run(self, fn: Callable[[], T], device: torch.device) -> T:
        """``fn()`` under ``no_grad``: on the bound thread (waiting for it, its exception re-raised), else here."""
        if self.cores is None:
            return fn()
        if self._executor is None or self._pid != os.getpid():  # a forked child has no copy of the thread
            self._executor = ThreadPoolExecutor(1, "offload_fsdp-host-step-bound", self.bind_this_thread)
            self._pid = os.getpid()
        return self._executor.submit(_on_device, fn, device).result()


def _on_device(fn: Callable[[], T], device: torch.device) -> T:
    # Grad mode and the current device are per thread: the caller's are not this thread's.
    if device.type != "cpu" and device.index is not None:
        torch.accelerator.set_device_index(device.index)
    with torch.no_grad():
        return fn()
