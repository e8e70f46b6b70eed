"""Checkpoints every few steps at near-zero cost: a node-local tier, replicated to a peer node, over durable storage.

::

    tiers = checkpoint.TieredCheckpointer("/dev/shm/run7", "s3://bucket/run7", local_every=1, durable_every=100)
    restored = tiers.restore(model=model, optimizer=opt)      # after a (re)start; None: nothing saved yet
    start = restored.step + 1 if restored else 0
    for step in range(start, steps):
        train_one_step()
        tiers.save(step, model=model, optimizer=opt, extra={"sched": sched.state_dict()})

**Local tier.** Every ``local_every`` steps each rank saves *its own* state (its local shards, as
whole tensors under the usual keys, :func:`checkpoint.api.rank_local`) to
``<local_dir>/rank<r>/step_<N>``: an ordinary committed checkpoint (same format, CRC-32s, manifest
and atomic commit; ``fsdp-ckpt verify`` checks it, ``checkpoint.load(..., rank_local=True)`` loads
it) of one rank, which only the same world size and sharding can restore. Put ``local_dir`` on a
node-local file system that outlives the process (``/dev/shm``, a local SSD): a restarted process
finds it. The last ``keep_local`` steps are kept.

**Replication.** Once written, each rank's local checkpoint is sent to ``replication`` ranks on other
nodes (:mod:`checkpoint.tier_topology`) over a gloo group (:mod:`checkpoint.tier_transfer`), which
commit it under their own ``local_dir`` as ``rank<r>/step_<N>`` after checking every byte.

**Durable tier.** Every ``durable_every`` steps the whole job also saves a normal checkpoint (any world
size can load it) at ``<durable_dir>/step_<N>`` (a path or a URL), ``keep_durable`` of them kept.

**Cost.** ``save`` blocks only while this rank's state is copied into host staging buffers (a device
tensor device -> host, host-resident state such as ``HybridDeviceOptimizer``'s masters and moments
host -> host); one snapshot serves both tiers. Writing, committing, replicating and the durable save
run on the async-save writer thread (:mod:`checkpoint.async_save`; one save in flight: a save first
waits for the one before it). Host memory per rank: one snapshot of its state (kept for the next
save, :class:`~checkpoint.staging_pool.StagingPool`), one checkpoint's bytes per replica while it is
sent or received, and on the node-local file system ``keep_local x (1 + replication)`` copies of a
rank's state (its own and those it holds for others). The figure is logged at INFO when it changes.

**Restore.** Every rank checks which local steps it holds (its own and its replicas) against their
manifests' CRC-32s; one ``all_gather_object`` tells everyone; the newest step for which every rank's
checkpoint has a verified copy somewhere is chosen. A rank without a copy of its own receives it from
a peer (a wait bounded by ``peer_timeout_s``), every rank loads its own, and all agree on success.
Otherwise (nothing complete, a peer that never sent, a copy that arrived corrupt) every rank loads the
newest durable checkpoint and a warning names what was skipped. A corrupt copy is never loaded.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import PurePath
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.api import LoadResult, load, rank_local, training_state
from checkpoint.async_save import stage
from checkpoint.atomic import output_path
from checkpoint.commit import DEFAULT_MAX_CHUNK_BYTES, commit, write_rank
from checkpoint.convert import resolve_stateful
from checkpoint.errors import some_of
from checkpoint.gc_pause import paused_gc
from checkpoint.manifest import read_manifest, verify_files
from checkpoint.retention import committed_checkpoints, latest, retain
from checkpoint.safe_unpickle import check_saved_values
from checkpoint.save_errors import describe_error, raise_on_every_rank
from checkpoint.save_queue import lock, starting, submit, wait_for_async_save
from checkpoint.staging import copy_to_staging
from checkpoint.staging_pool import StagingPool
from checkpoint.state_dict_io import write_state_dict
from checkpoint.storage_backend import locate, storage_for
from checkpoint.tier_topology import Topology, detect_nodes
from checkpoint.tier_transfer import exchange, read_checkpoint_bytes

__all__ = ["Restored", "TieredCheckpointer"]

logger = logging.getLogger(__name__)

_STEP = re.compile(r"step_([0-9]+)\Z")


@dataclass
class Restored:
    """What :meth:`TieredCheckpointer.restore` loaded."""

    step: int
    """the step saved"""
    source: str
    """``"local"`` (every rank its own copy), ``"peer"`` (some ranks received theirs from a replica) or ``"durable"``"""
    extra: LoadResult
    """the ``extra`` dict saved with it (see :func:`checkpoint.load`)"""
    skipped: list[str]
    """why newer local steps were not used (empty when none were skipped)"""


class TieredCheckpointer:
    """Saves to a node-local tier every ``local_every`` steps and to durable storage every ``durable_every``.

    Create it on every rank, at the same point (it creates two gloo process groups). ``nodes``: the
    node of each rank (default :func:`~checkpoint.tier_topology.detect_nodes`); ``replication``: copies of
    each rank's local checkpoints on other nodes (default 1 when the job spans two nodes or more, else 0);
    ``peer_timeout_s``: the longest wait for a peer's copy. ``run``: names the training run whose local
    copies :meth:`restore` may use (default: the durable dir as a string); a copy saved under another run
    name is skipped, never loaded: pass the same ``run`` when the directories are moved or remounted
    elsewhere. See the module docstring for the costs.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike,
        durable_dir: str | os.PathLike,
        *,
        local_every: int = 1,
        durable_every: int = 100,
        keep_local: int = 2,
        keep_durable: int | None = None,
        replication: int | None = None,
        nodes: Sequence[Hashable] | None = None,
        peer_timeout_s: float = 60.0,
        storage_options: dict | None = None,
        run: str | None = None,
    ) -> None:
        for name, value in (("local_every", local_every), ("durable_every", durable_every)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: never), got {value}")
        if keep_local < 1:
            raise ValueError(
                f"keep_local must be at least 1 (the newest local step is the one restored), got {keep_local}"
            )
        self.local_dir = locate(local_dir)
        self.durable_dir = locate(durable_dir, storage_options)
        self.run = str(self.durable_dir) if run is None else run
        self.local_every, self.durable_every = local_every, durable_every
        self.keep_local, self.keep_durable = keep_local, keep_durable
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if nodes is None:
            nodes = detect_nodes() if self.distributed else [0]
        if len(nodes) != self.world_size:
            raise ValueError(
                f"nodes must name the node of each of the {self.world_size} ranks, got {len(nodes)}: {nodes}"
            )
        if replication is None:
            replication = 1 if len(set(nodes)) > 1 else 0
        self.topology = Topology.of(nodes, replication)
        self.peer_timeout_s = peer_timeout_s
        self._control = dist.new_group(backend="gloo") if self.distributed else None
        self._transfer = self._new_transfer_group()
        self._pool = StagingPool()
        self._reported_bytes = -1

    # ---- saving

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Future | None:
        """Save step ``step`` to the tiers it is due for; every rank calls it after every step.

        Blocks while this rank's state is copied into host staging buffers (one snapshot serves both
        tiers); returns the future of the background work (``None`` when no tier was due), resolved once
        the local checkpoint is committed and replicated and the durable one committed. A failure is
        logged at ERROR and raised by the next save (:class:`checkpoint.AsyncSaveError`) or :meth:`wait`.
        """
        local = self.local_every > 0 and step % self.local_every == 0
        durable = self.durable_every > 0 and step % self.durable_every == 0
        if not (local or durable):
            return None
        with paused_gc():
            state = training_state(model, optimizer, extra)
        if durable:
            return self._stage_and_submit(self.durable_path(step), state, step, local)
        # A local-only step (most of them): no collective; the snapshot is the rank-local state itself.
        if "extra" in state:
            state["extra"], _ = resolve_stateful(state["extra"])  # only extra holds Stateful objects
        mine = rank_local(state)
        with starting(), lock:
            wait_for_async_save()  # one save in flight: the staging buffers are free again
            self._pool.begin_save(reuse=True)
            snapshot = _snapshot(mine, self._pool)
            future = submit(self.local_path(self.rank, step), self._write_local, snapshot, step)
            self._pool.end_staging()
        return future

    def _stage_and_submit(self, path: PurePath, state: dict[str, Any], step: int, local: bool) -> Future:
        """A durable step: one global snapshot (DTensor metadata kept) for both tiers."""
        with starting(), lock:
            wait_for_async_save()
            error: Exception | None = None
            try:
                state, _ = resolve_stateful(state)
                check_saved_values(state)
                self._pool.begin_save(reuse=True)
                staged = stage(
                    state, rank=self.rank, scale=False, max_chunk_bytes=DEFAULT_MAX_CHUNK_BYTES, pool=self._pool
                )
            except Exception as exc:  # noqa: BLE001 - raised on every rank
                error = exc
            # The writers meet in collectives: a rank that could not stage must not send the others there.
            raise_on_every_rank(error, path, group=self._control, distributed=self.distributed)
            future = submit(path, self._write, staged, step, local)
            self._pool.end_staging()
        return future

    def wait(self) -> None:
        """Wait for the save in flight (write, commit, replication); raise its failure if it failed."""
        wait_for_async_save()

    def local_path(self, rank: int, step: int) -> PurePath:
        """Where ``rank``'s checkpoint of ``step`` sits in this node's ``local_dir`` (its own, or a replica)."""
        return self._rank_dir(rank) / f"step_{step:08d}"

    def durable_path(self, step: int) -> PurePath:
        return self.durable_dir / f"step_{step:08d}"

    def _rank_dir(self, rank: int) -> PurePath:
        return self.local_dir / f"rank{rank}"

    def _write(self, staged: dict[str, Any], step: int, local: bool) -> None:
        """On the writer thread: the local checkpoint and its replicas when due, then the durable checkpoint."""
        if local:
            self._write_local(rank_local(staged), step)
        write_state_dict(
            staged,
            output_path(self.durable_path(step)),
            max_chunk_bytes=DEFAULT_MAX_CHUNK_BYTES,
            process_group=self._control,
            keep_last=self.keep_durable,
            distributed=self.distributed,
        )

    def _write_local(self, mine: dict[str, Any], step: int) -> None:
        """Commit this rank's checkpoint, keep the newest, replicate it.

        A value that would not load weights-only fails here (the next save raises it), not in the caller.
        """
        path = self.local_path(self.rank, step)
        check_saved_values(mine)
        write_rank(path, 0, 1, mine)
        info = {**self._belongs(self.rank), "step": step}
        commit(path, 1, extra_info=info)
        retain(path, keep_last=self.keep_local, wait=False)
        if self.topology.replication:
            outgoing = [read_checkpoint_bytes(path, peer) for peer in self.topology.peers(self.rank)]
            incoming = {source: self.local_path(source, step) for source in self.topology.sources(self.rank)}
            exchange(outgoing, incoming, group=self._transfer)
            for source in incoming:
                retain(self._rank_dir(source), keep_last=self.keep_local, wait=False)
        self._report_memory()

    def _report_memory(self) -> None:
        on_disk = sum(_tree_bytes(self._rank_dir(r)) for r in [self.rank, *self.topology.sources(self.rank)])
        total = on_disk + self._pool.held_bytes
        if total != self._reported_bytes:
            self._reported_bytes = total
            logger.info(
                "local checkpoint tier of rank %d: %.1f MiB (%.1f MiB host snapshot + %.1f MiB in %s: the last %d "
                "steps of rank %d and of the ranks it holds copies for, %s)",
                self.rank,
                total / 2**20,
                self._pool.held_bytes / 2**20,
                on_disk / 2**20,
                self.local_dir,
                self.keep_local,
                self.rank,
                self.topology.sources(self.rank) or "none",
            )

    # ---- restoring

    def restore(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Restored | None:
        """Load the newest step every rank can restore from the local tier, else the newest durable one.

        Every rank calls it. Returns ``None`` when nothing was ever saved (neither tier holds a
        checkpoint); raises ``FileNotFoundError`` when local steps exist but none is complete and no
        durable checkpoint exists. ``extra`` as in :func:`checkpoint.load`.
        """
        wait_for_async_save()
        held, problems = self._verified_local_steps()
        everyone = self._gather((held, problems))
        step, sources, skipped = self._newest_complete(everyone)
        # Rank 0's view of the durable tier decides for everyone (a listing may lag on other ranks).
        durable = self._gather(self._durable_step() if self.rank == 0 else None)[0]
        if step is not None and durable is not None and durable > step:
            skipped.append(f"local step {step}: the durable checkpoint of step {durable} is newer")
            step = None
        if step is not None:
            restored = self._restore_local(step, sources, skipped, model, optimizer, extra)
            if restored is not None:
                return restored
        return self._restore_durable(skipped, model, optimizer, extra)

    def _verified_local_steps(self) -> tuple[dict[int, list[int]], list[str]]:
        """The steps of each rank's checkpoints this rank holds whose every byte matches the manifest."""
        held: dict[int, list[int]] = {}
        problems: list[str] = []
        for owner in [self.rank, *self.topology.sources(self.rank)]:
            held[owner] = []
            for path in committed_checkpoints(self._rank_dir(owner)):
                match = _STEP.match(path.name)
                if match is None:
                    continue
                problem = self._copy_problem(path, owner, int(match.group(1)))
                if problem is None:
                    held[owner].append(int(match.group(1)))
                else:
                    problems.append(f"rank {self.rank} skipped {path}: {problem}")
        return held, problems

    def _belongs(self, owner: int) -> dict[str, Any]:
        """What a local checkpoint of ``owner``'s records of its origin."""
        return {"tier": "local", "rank": owner, "world_size": self.world_size, "run": self.run}

    def _copy_problem(self, path: PurePath, owner: int, step: int) -> str | None:
        try:
            manifest = read_manifest(path)
        except (OSError, ValueError) as exc:  # NotACheckpointError, CheckpointCorruptError are ValueErrors
            return describe_error(exc)
        info = manifest.extra_info
        # A copy of another run (another durable dir) or of another step (a late replica) is never offered.
        if {k: info.get(k) for k in (*self._belongs(owner), "step")} != {**self._belongs(owner), "step": step}:
            return (
                f"it is not rank {owner} of {self.world_size} ranks' local checkpoint of step {step} of run "
                f"{self.run!r} ({info})"
            )
        problems = verify_files(path, manifest, checksums=True)
        return "; ".join(p.replace(f"{path}/", "") for p in problems[:3]) if problems else None

    def _newest_complete(
        self, everyone: list[tuple[dict[int, list[int]], list[str]]]
    ) -> tuple[int | None, dict[int, int], list[str]]:
        """The newest step with a verified copy of every rank's checkpoint, who provides each, and what
        was skipped on the way (the same on every rank: computed from the gathered view)."""
        skipped = [problem for _, problems in everyone for problem in problems]
        steps = sorted({s for held, _ in everyone for owned in held.values() for s in owned}, reverse=True)
        for step in steps:
            sources: dict[int, int] = {}
            for rank in range(self.world_size):
                holders = [h for h in self.topology.holders(rank) if step in everyone[h][0].get(rank, ())]
                if not holders:
                    skipped.append(f"step {step}: no verified copy of rank {rank}'s checkpoint on its node or a peer")
                    break
                sources[rank] = holders[0]
            else:
                return step, sources, skipped
        return None, {}, skipped

    def _restore_local(self, step, sources, skipped, model, optimizer, extra) -> Restored | None:
        """Fetch what is missing from the peers, load every rank's own copy; ``None`` when any rank failed."""
        error: BaseException | None = None
        result = None
        try:
            outgoing = [
                read_checkpoint_bytes(self.local_path(owner, step), owner)
                for owner, holder in sources.items()
                if holder == self.rank and owner != self.rank
            ]
            incoming = {} if sources[self.rank] == self.rank else {sources[self.rank]: self.local_path(self.rank, step)}
            exchange(outgoing, incoming, group=self._transfer)
            result = load(
                self.local_path(self.rank, step), model=model, optimizer=optimizer, extra=extra, rank_local=True
            )
        except Exception as exc:  # noqa: BLE001 - agreed on below; the durable tier is loaded instead
            error = exc
        failures = [f for f in self._gather(None if error is None else describe_error(error)) if f is not None]
        if failures:
            self._transfer = self._new_transfer_group()  # a timed-out gloo group may not be usable again
            skipped.append(f"step {step}: restoring it failed on {len(failures)} rank(s): {some_of(failures)}")
            return None
        self._drop_local_after(step)
        assert result is not None
        fetched = any(holder != owner for owner, holder in sources.items())
        logger.info("restored step %d from the local tier%s", step, " (copies from peers)" if fetched else "")
        if skipped:
            logger.warning("restoring step %d, skipped newer local steps: %s", step, some_of(skipped))
        return Restored(step, "peer" if fetched else "local", result, skipped)

    def _durable_step(self) -> int | None:
        path = latest(self.durable_dir)
        match = None if path is None else _STEP.match(PurePath(path).name)
        return int(match.group(1)) if match else None

    def _restore_durable(self, skipped, model, optimizer, extra) -> Restored | None:
        path = latest(self.durable_dir)
        if path is None:
            if skipped:
                raise FileNotFoundError(
                    f"no local step can be restored ({some_of(skipped)}) and {self.durable_dir} holds no committed "
                    "checkpoint: the training state is lost; start from scratch with empty local and durable dirs"
                )
            return None
        match = _STEP.match(PurePath(path).name)
        step = int(match.group(1)) if match else -1
        if skipped:
            logger.warning("loading the durable checkpoint %s; the local tier was skipped: %s", path, some_of(skipped))
        result = load(path, model=model, optimizer=optimizer, extra=extra)
        self._drop_local_after(step)
        return Restored(step, "durable", result, skipped)

    def _drop_local_after(self, step: int) -> None:
        """Delete local steps newer than the one restored: the run goes on from ``step``, they are of another past."""
        for owner in [self.rank, *self.topology.sources(self.rank)]:
            for path in committed_checkpoints(self._rank_dir(owner)):
                match = _STEP.match(path.name)
                if match is not None and int(match.group(1)) > step:
                    storage_for(path).remove_tree(path, ignore_errors=True)

    # ---- communication

    def _new_transfer_group(self) -> dist.ProcessGroup | None:
        if not self.distributed:
            return None
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.peer_timeout_s))

    def _gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, value, group=self._control)
        return everyone


def _snapshot(tree: Any, pool: StagingPool) -> Any:
    """``tree`` with every tensor copied into ``pool``'s buffer for its dotted key (other values as they are)."""
    devices: set[torch.device] = set()

    def copy(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: copy(v, f"{key}{k}.") for k, v in value.items()}
        if type(value) in (list, tuple):  # plain ones: a named tuple is rebuilt otherwise
            return type(value)(copy(v, f"{key}{i}.") for i, v in enumerate(value))
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                devices.add(value.device)
            return copy_to_staging(pool, key, value)
        return value

    snapshot = copy(tree, "")
    for device in devices:
        # The non-blocking D2H copies must land before the writer thread reads the snapshot.
        torch.accelerator.synchronize(device)
    return snapshot


def _tree_bytes(path: PurePath) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    store = storage_for(path)
    found = store.stat(path)
    if found is None or found.kind not in ("file", "directory"):
        return 0
    if found.kind == "file":
        return found.size
    return sum(_tree_bytes(path / name) for name in store.list(path))
