"""Running ``fsdp-ckpt`` under ``torchrun``: which process does what, and failing together.

Without ``torchrun`` (``WORLD_SIZE`` unset or 1) everything is :data:`SOLO`,
a group of one whose synchronisation is a no-op. Under ``torchrun
--nproc-per-node P`` the processes join a gloo group and split the work
(export: safetensors shards or torch-file tensors; reshard / import: the
destination ranks' data files). inspect, verify and diff run on process 0
only; the others exit 0 at once. Only two kinds of collective are
used, both at fixed points: :meth:`Group.agree` (did every process get here
without an error? if not, all raise, so none waits forever) and
:meth:`Group.gather` (small per-process results, e.g. file records, to every
process).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from checkpoint.save_errors import agree_on_failure

__all__ = ["Group", "PeerFailed", "SOLO", "join_group", "leave_group"]


class PeerFailed(Exception):
    """Another process of the group failed; its one-line reason is the message."""


class Group:
    """This process's place among the ``size`` processes of one ``fsdp-ckpt`` run."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size

    def mine(self, index: int) -> bool:
        """Whether work item ``index`` (a destination rank, a batch) is this process's: round robin."""
        return index % self.size == self.rank

    def share(self, sizes: list[int]) -> list[bool]:
        """Which items are mine when each, largest first, goes to the least-loaded process (same answer everywhere)."""
        load = [0] * self.size
        owner = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            p = min(range(self.size), key=lambda p: (load[p], p))
            owner[i] = p
            load[p] += sizes[i]
        return [o == self.rank for o in owner]

    def together(self, step, *, only_rank0: bool = False) -> Any:
        """Run ``step()`` (on rank 0 only, if asked), then :meth:`agree` on whether it failed anywhere."""
        result, error = None, None
        if not only_rank0 or self.rank == 0:
            try:
                result = step()
            except BaseException as exc:  # noqa: BLE001 - handed to every process by agree()
                error = exc
        self.agree(error)
        return result

    def agree(self, error: BaseException | None = None) -> None:
        """Every process calls this at the same point; raises if any process reports an error.

        A process that failed passes its exception and gets it re-raised; the
        others raise :class:`PeerFailed` naming the first failing process.
        """
        failures = agree_on_failure(error, group=None, distributed=self.size > 1)
        if failures:
            rank = min(failures)
            raise PeerFailed(f"process {rank} of {self.size} failed: {failures[rank]}")

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every process, in process order (picklable, small)."""
        if self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out


SOLO = Group()


def join_group() -> Group:
    """The group of this run: :data:`SOLO`, or (under ``torchrun``) a gloo group over ``WORLD_SIZE`` processes."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return SOLO
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return Group(dist.get_rank(), dist.get_world_size())


def leave_group(group: Group) -> None:
    """Tear the gloo group down: exiting with its threads alive aborts the process ("terminate called ...")."""
    if group.size == 1:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
