"""The collective save without DCP's per-item planning: each rank's write plan and the metadata, cached per layout.

DCP plans every save from scratch: a ``WriteItem`` per chunk on every rank,
the plans gathered, de-duplicated, validated and turned into ``Metadata`` by
the coordinator, then scattered back (~90 us per tensor before a byte is
written). A training job saves the same layout again and again, so here the
plan is made once per *layout* and kept:

* a rank's layout is the list of its entries: every key with its nested path
  (DCP's ``planner_data``), and for a tensor its dtype, global shape and the
  chunks this rank holds (:func:`local_layout`); it is rebuilt each save
  (O(local keys), no communication) and compared with the cached one;
* the first save of a layout (or any save after one rank's layout changed:
  a new or removed key, a shape, dtype, sharding or world size, a new group
  option) sends the layouts to the coordinator, which de-duplicates replicas
  as DCP does (each to the least loaded holder), builds the ``Metadata``
  skeleton and checks exact cover (:func:`plan_layouts`); each rank is told
  which of its items it writes;
* later saves send only the plan's id; the coordinator's work per save is
  O(keys) (the manifest), and when no rank's storage offsets moved (same
  sizes of pickled values) it writes the previous ``.metadata`` bytes again.

Collectives per save, whatever the number of tensors (four calls): a gather
(each rank's plan id or layout, and its error converting its state; the
coordinator first prepares the target), a scatter (the decision, or every
rank's errors), the rank's writes, a gather (its file's size and CRC-32, its
storage offsets only when they moved, or its error), the coordinator's commit, a
broadcast (the commit's outcome). An error on any rank raises on every rank.
One process (no process group) does the same without communication.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from checkpoint.commit import ManifestKeys, manifest_keys
from checkpoint.convert import flatten_state_dict
from checkpoint.data_file import StorageInfo, data_file_name
from checkpoint.dcp_metadata import MetadataBuilder, metadata_bytes, with_storage, write_metadata
from checkpoint.layout import Box
from checkpoint.manifest import METADATA_NAME, FileRecord
from checkpoint.planner import metadata_problems
from checkpoint.save_errors import CheckpointSaveError, describe_error
from checkpoint.shard import CheckpointShard
from checkpoint.staging import StagedShard
from checkpoint.storage import write_items

__all__ = ["PlannedSave", "local_layout", "plan_layouts"]

Entry = tuple
"""One key of a rank's layout: ``(key, path)`` for a pickled value, ``(key, path, dtype, shape, chunks)``
for a tensor, ``chunks`` the ``(offsets, sizes)`` boxes this rank writes (none when another rank writes them)."""


def local_layout(flat: dict[str, Any], paths: dict[str, tuple]) -> list[Entry]:
    """This rank's layout from its flattened, converted state (values :class:`CheckpointShard`, plain tensors
    stored whole, or plain values)."""
    entries: list[Entry] = []
    for key, value in flat.items():
        if isinstance(value, CheckpointShard):
            chunks = tuple(value.chunks) if value.writes else ()
            entries.append((key, paths[key], value.dtype, tuple(value.shape), chunks))
        elif type(value) is torch.Tensor:  # stored whole as one chunk (converted with whole_as_is)
            shape = tuple(value.shape)
            entries.append((key, paths[key], value.dtype, shape, (Box((0,) * len(shape), shape),)))
        else:
            entries.append((key, paths[key]))
    return entries


def _items(entries: list[Entry]) -> list[tuple[MetadataIndex, int]]:
    """A rank's write items in file order (pickled values first, then chunks, as DCP's writer orders them),
    each with its size in bytes (1 for a pickled value: unknown before it is pickled, as in DCP's balancing)."""
    values = [(MetadataIndex(e[0]), 1) for e in entries if len(e) == 2]
    chunks = [
        (MetadataIndex(e[0], torch.Size(box.offsets)), _numel(box.sizes) * e[2].itemsize)
        for e in entries
        if len(e) == 5
        for box in e[4]
    ]
    return values + chunks


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


@dataclass
class GlobalPlan:
    """What the coordinator keeps of a plan: the metadata skeleton and every rank's kept items."""

    plan_id: int
    """a random id every rank keeps with its part of the plan"""
    skeleton: Metadata
    """``Metadata`` without storage: keys, chunks, planner data"""
    indices: list[list[MetadataIndex]]
    """per rank, the items it writes, in its file order"""
    layouts: list[list[Entry]]
    """per rank, the layout the plan was made from"""
    storage: list[list[tuple[str, int, int]] | None] = field(default_factory=list)
    """per rank, where its items landed in the last save"""
    pickled: bytes | None = None
    """the last save's ``.metadata`` bytes"""
    metadata: Metadata | None = None
    """the last save's ``Metadata``"""
    keys: ManifestKeys | None = None
    """what the last save's manifest recorded of its keys (:func:`~checkpoint.commit.manifest_keys`)"""


def plan_layouts(layouts: list[list[Entry]]) -> tuple[GlobalPlan, list[list[int]]]:
    """The global plan for every rank's layout, and per rank the positions (in :func:`_items` order) it writes.

    Replicas (same key and chunk offsets on several ranks) go to the holder with
    the fewest bytes planned so far, lowest rank first, as DCP's planner does.
    Raises ``ValueError`` naming the key when ranks disagree on a key's shape or
    dtype, or when the chunks would not cover a tensor exactly.
    """
    builder = MetadataBuilder()
    rank_items = [_items(entries) for entries in layouts]
    holders: dict[MetadataIndex, list[int]] = {}
    sizes: dict[MetadataIndex, int] = {}
    for rank, entries in enumerate(layouts):
        for entry in entries:
            key, path = entry[0], entry[1]
            builder.path(key, path)
            if len(entry) == 2:
                builder.byte_value(key)
                continue
            _, _, dtype, shape, chunks = entry
            builder.tensor(key, dtype, shape, source=f"rank {rank}")
            for box in chunks:
                builder.chunk(key, box.offsets, box.sizes)
        for index, size in rank_items[rank]:
            holders.setdefault(index, []).append(rank)
            sizes[index] = size
    load = [0] * len(layouts)
    owner: dict[MetadataIndex, int] = {}
    for index, ranks in holders.items():
        chosen = min(ranks, key=lambda r: load[r])  # first of the least loaded: the lowest rank on a tie
        owner[index] = chosen
        load[chosen] += sizes[index]
    skeleton = builder.build(require_storage=False)
    problems = metadata_problems(skeleton, overlap=False)
    if problems:
        raise ValueError("checkpoint would be incomplete: " + "; ".join(problems[:5]))
    keep = [[i for i, (index, _) in enumerate(items) if owner[index] == rank] for rank, items in enumerate(rank_items)]
    indices = [[rank_items[r][i][0] for i in kept] for r, kept in enumerate(keep)]
    plan = GlobalPlan(uuid.uuid4().int, skeleton, indices, layouts, storage=[None] * len(layouts))
    return plan, keep


@dataclass
class _RankPlan:
    """What every rank keeps of a plan: its id, the layout it was made for, the items it writes."""

    plan_id: int
    layout: list[Entry]
    items: list[tuple[MetadataIndex, bool]]
    storage: list[tuple[str, int, int]] | None = None
    """where the items landed in the last save"""


@dataclass
class _Cache:
    rank: _RankPlan | None = None
    coordinator: GlobalPlan | None = None


_caches: dict[tuple, _Cache] = {}
_RESEND = "resend"


def _cache_for(group: dist.ProcessGroup | None, rank: int, world_size: int) -> _Cache:
    # One plan kept per process group (an async save's own group has its own); the plan id, checked
    # on every rank each save, makes a stale one harmless (it is simply made again).
    return _caches.setdefault((id(group), rank, world_size), _Cache())


class PlannedSave:
    """One collective save of ``state_dict`` into the staging directory ``directory``; see the module docstring.

    ``convert(state_dict)`` gives the :class:`CheckpointShard` tree; ``prepare()`` runs on the coordinator
    (rank 0) before any rank writes; ``commit(metadata, files, keys)`` on the coordinator once every data file
    and ``.metadata`` are durable (``files``: their records; ``keys``: :func:`~checkpoint.commit.manifest_keys`).
    """

    def __init__(
        self,
        directory,
        *,
        convert: Callable[[dict], dict],
        prepare: Callable[[], None],
        commit: Callable[[Metadata, dict[str, FileRecord], ManifestKeys], None],
        group: dist.ProcessGroup | None,
        distributed: bool,
        path,
    ) -> None:
        self.directory = directory
        self.convert, self.prepare, self.commit = convert, prepare, commit
        self.group, self.distributed, self.path = group, distributed, path
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.cache = _cache_for(group if distributed else None, self.rank, self.world_size)
        self._plan_error: BaseException | None = None

    def run(self, state_dict: dict[str, Any]) -> None:
        flat, mine, error = self._convert(state_dict)
        plan, error = self._agree_on_plan(mine, error)
        record = storage = None
        if plan is not None:
            try:
                record, storage = self._write(flat, plan)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = exc
        self._finish(record, storage, error)

    # --- step 1: convert, and agree on the plan (one gather + one scatter) ---

    def _convert(self, state_dict) -> tuple[dict, list[Entry] | None, BaseException | None]:
        try:
            flat, paths = flatten_state_dict(self.convert(state_dict))
            layout = local_layout(flat, paths)
            if self.rank == 0:
                self.prepare()
            return flat, layout, None
        except Exception as exc:  # noqa: BLE001 - raised on every rank by _agree_on_plan
            return {}, None, exc

    def _agree_on_plan(self, layout, error) -> tuple[_RankPlan | None, BaseException | None]:
        cached = self.cache.rank
        plan_id = cached.plan_id if cached is not None and cached.layout == layout else None
        message = describe_error(error) if error is not None else None
        answer = self._exchange((message, plan_id, None if plan_id is not None else layout))
        if answer == _RESEND:  # the coordinator lacks some rank's layout (its plan was lost): all send theirs
            answer = self._exchange((message, None, layout))
        if error is not None:
            return None, error
        failures, plan_id, keep = answer
        if failures:
            own = self._plan_error if self.rank == 0 else None
            return None, own or CheckpointSaveError(self.path, failures)
        if keep is not None:  # a new plan: keep this rank's part of it
            items = _items(layout)
            self.cache.rank = _RankPlan(plan_id, layout, [(items[i][0], items[i][0].offset is None) for i in keep])
        assert self.cache.rank is not None and self.cache.rank.plan_id == plan_id
        return self.cache.rank, None

    def _exchange(self, offer):
        """Every rank's offer to the coordinator, its answer back (a gather and a scatter)."""
        offers = self._gather(offer)
        answers: list[Any] = [None] * self.world_size
        if self.rank == 0:
            assert offers is not None
            answers = self._decide(offers)
        return self._scatter(answers)

    def _decide(self, offers: list) -> list:
        """Coordinator: the answer for every rank: ``(failures, plan id, positions to write or None)``, or :data:`_RESEND`."""
        failures = {r: message for r, (message, _, _) in enumerate(offers) if message is not None}
        if failures:
            return [(failures, None, None)] * self.world_size
        known = self.cache.coordinator
        unchanged = [plan_id is not None and known is not None and plan_id == known.plan_id for _, plan_id, _ in offers]
        if all(unchanged):
            return [(None, offers[0][1], None)] * self.world_size
        if any(plan_id is not None and not same for (_, plan_id, _), same in zip(offers, unchanged)):
            return [_RESEND] * self.world_size
        # Some rank's layout changed (or this is the first save): plan again, from what each rank sent
        # or, for a rank whose layout is unchanged, what the last plan was made from.
        layouts = [
            layout if layout is not None else known.layouts[r]  # type: ignore[union-attr]  # unchanged: known
            for r, (_, _, layout) in enumerate(offers)
        ]
        try:
            plan, keep = plan_layouts(layouts)
        except Exception as exc:  # noqa: BLE001 - rank 0 raises it, the others a CheckpointSaveError naming it
            self._plan_error = exc
            return [({0: describe_error(exc)}, None, None)] * self.world_size
        self.cache.coordinator = plan
        return [(None, plan.plan_id, kept) for kept in keep]

    # --- step 2: write this rank's file ---

    def _write(self, flat: dict[str, Any], plan: _RankPlan) -> tuple[tuple[str, FileRecord] | None, list]:
        if not plan.items:
            return None, []
        pickled: dict[int, bytes] = {}

        def resolve(index: MetadataIndex):
            value = flat[index.fqn]
            if index.offset is None:
                # Shared objects (a group's options, keyed once per parameter) are pickled once.
                if id(value) not in pickled:
                    buffer = io.BytesIO()
                    torch.save(value, buffer)  # as DCP's planner pickles a value, so plain dcp.load reads it
                    pickled[id(value)] = buffer.getvalue()
                return pickled[id(value)]
            return value if type(value) is torch.Tensor else value.__get_tensor_shard__(index)

        gates = {v.gate for v in flat.values() if isinstance(v, StagedShard)}
        name = data_file_name(f"__{self.rank}_")
        where, record = write_items(self.directory, name, plan.items, resolve, gates=gates)
        return record, [(w.relative_path, w.offset, w.length) for w in where]

    # --- step 3: the coordinator writes .metadata and commits (one gather + one broadcast) ---

    def _finish(self, record, storage, error) -> None:
        mine = self.cache.rank if error is None else None
        moved = storage if mine is None or storage != mine.storage else None
        results = self._gather((describe_error(error) if error else None, record, moved))
        outcome: dict[int, str] | None = None
        commit_error: BaseException | None = None
        if self.rank == 0:
            assert results is not None
            outcome = {r: message for r, (message, _, _) in enumerate(results) if message is not None}
            if not outcome:
                try:
                    self._commit(results)
                except Exception as exc:  # noqa: BLE001 - every rank raises it
                    commit_error = exc
                    outcome = {0: describe_error(exc)}
        outcome = self._broadcast(outcome)
        if error is None and not outcome and mine is not None:
            mine.storage = storage  # the coordinator now holds the same
        if error is not None:
            raise error
        if commit_error is not None:
            raise commit_error
        if outcome:
            raise CheckpointSaveError(self.path, outcome)

    def _commit(self, results: list) -> None:
        plan = self.cache.coordinator
        assert plan is not None  # made by _decide on this rank
        files: dict[str, FileRecord] = {}
        changed = plan.pickled is None
        for rank, (_, record, moved) in enumerate(results):
            if record is not None:
                files[record[0]] = record[1]
            if moved is not None:
                plan.storage[rank] = moved
                changed = True
        if changed:  # else the last save's .metadata and manifest records, unchanged (no item moved)
            plan.metadata = self._metadata(plan)
            plan.pickled = metadata_bytes(plan.metadata)
            plan.keys = manifest_keys(plan.metadata)
        assert plan.pickled is not None and plan.metadata is not None and plan.keys is not None
        files[METADATA_NAME] = write_metadata(self.directory, plan.pickled)
        self.commit(plan.metadata, files, plan.keys)

    @staticmethod
    def _metadata(plan: GlobalPlan) -> Metadata:
        # One object per stored range, so the keys of a value stored once (a group's options) share it
        # in the pickled .metadata (a memo reference instead of a copy per key).
        infos: dict[tuple[str, int, int], StorageInfo] = {}
        stored = {
            index: infos.get(where) or infos.setdefault(where, StorageInfo(*where))
            for indices, places in zip(plan.indices, plan.storage)
            for index, where in zip(indices, places or ())
        }
        return with_storage(plan.skeleton, stored)

    # --- collectives (none in one process) ---

    def _gather(self, obj) -> list | None:
        if not self.distributed:
            return [obj]
        out: list | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._coordinator(), group=self.group)
        return out

    def _scatter(self, objs: list):
        if not self.distributed:
            return objs[0]
        out: list = [None]
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=self._coordinator(), group=self.group)
        return out[0]

    def _broadcast(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._coordinator(), group=self.group)
        return box[0]

    def _coordinator(self) -> int:
        """The global rank of the group's rank 0 (torch's object collectives take global ranks)."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0
