"""``checkpoint.save`` / ``checkpoint.load``: model + optimizer + extra, any world size and layout."""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import Future
from functools import cache, partial
from typing import Any

import torch

# set_element: DCP's own way to rebuild a nested dict from planner_data paths (no public name);
# renamed -> import fails, changed path format -> loaded values land in the wrong place
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from checkpoint.async_save import async_save_state_dict
from checkpoint.convert import StatefulPath, load_stateful, resolve_stateful
from checkpoint.errors import some_of
from checkpoint.gc_pause import paused_gc
from checkpoint.shard import CheckpointShard
from checkpoint.state_dict_io import (
    DEFAULT_MAX_READ_BYTES,
    LoadReport,
    OpenCheckpoint,
    ReadOptions,
    load_flat,
    load_on_every_rank,
    open_checkpoint,
    read_options,
    save_state_dict,
)
from checkpoint.storage_backend import locate
from checkpoint.training_state import (
    LEGACY_MASTER_KEYS,
    MASTER_PARAM,
    SAVED_WITHOUT_STATE,
    TIED_SECTION,
    key_path,
    load_optimizer_state,
    model_entries,
    optimizer_entries,
    param_fqns,
    tied_aliases,
)
from offload_fsdp.fresh_state import checkpoint_state
from offload_fsdp.grad import local_tensor

__all__ = ["LoadResult", "async_save", "load", "rank_local", "save", "training_state"]

logger = logging.getLogger(__name__)

_ASYNC_ONLY = ("max_staging_bytes", "reuse_staging_buffers")


class LoadResult(dict):
    """The ``extra`` dict saved with the checkpoint, plus what the load skipped (non-strict).

    ``missing_keys`` / ``unexpected_keys`` / ``mismatched_keys`` are empty after a strict load.
    """

    def __init__(self, extra: dict[str, Any], report: LoadReport) -> None:
        super().__init__(extra)
        self.report = report
        self.missing_keys = report.missing_keys
        self.unexpected_keys = report.unexpected_keys
        self.mismatched_keys = report.mismatched_keys


def training_state(model, optimizer, extra) -> dict[str, Any]:
    """What :func:`save` writes: ``{"model": ..., "optimizer": ..., "extra": ...}`` keyed by parameter names."""
    if optimizer is not None and model is None:
        raise ValueError("saving an optimizer needs its model too (state is keyed by parameter names)")
    state: dict[str, Any] = {}
    if model is not None:
        state["model"] = model_entries(model)
        aliases = tied_aliases(model)
        if aliases:
            # both names stay stored (plain dcp.load asks for both); export reads this to write one
            state[TIED_SECTION] = aliases
    if optimizer is not None:
        # The optimizer leaves out what is redundant (a master equal to its weight) by itself.
        osd, _ = checkpoint_state(optimizer, for_save=True)
        entries = optimizer_entries(optimizer, osd, param_fqns(model))
        state["optimizer"] = {
            "state": entries.state,
            "param_groups": {**entries.param_groups, **entries.indexed_groups},
            # lets a strict load tell "saved before the first step" from "state lost"
            SAVED_WITHOUT_STATE: entries.without_state(),
        }
    if extra:
        state["extra"] = dict(extra)
    return state


def save(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    async_: bool = False,
    **options: Any,
) -> Future | None:
    """Save ``model``, ``optimizer`` and ``extra`` (step, RNG states, scheduler state...) at ``path``.

    Every rank calls it. Options: ``mode`` (``"collective"`` | ``"scale"``),
    ``max_chunk_bytes``, ``process_group``, ``storage_options`` (``path`` may be a URL such as
    ``s3://bucket/prefix``), ``keep_last`` (retention), ``lock_timeout`` (see :func:`checkpoint.save_state_dict`).
    With ``async_=True`` returns a future once the state is staged (see
    :func:`checkpoint.async_save`); then ``max_staging_bytes`` bounds the
    staging copies (see :mod:`checkpoint.async_save` for the trade-off), and
    ``reuse_staging_buffers=False`` stages into fresh host memory that is freed
    after the save instead of kept for the next one (see
    :func:`checkpoint.release_staging_buffers`).

    Guarantees (see :func:`checkpoint.save_state_dict`): ``path`` ends as the
    previous checkpoint or the whole new one; a save to a path being written
    waits for it; a target that is not a checkpoint is refused before anything
    is written; an error on any rank raises an ``Exception`` on every rank. An
    async save's failure is logged at ERROR and raised by ``future.result()``,
    or else by the next save (:class:`checkpoint.AsyncSaveError`).
    """
    for name in _ASYNC_ONLY:
        if not async_ and name in options:
            raise ValueError(f"{name} only applies to an async save: pass async_=True or call checkpoint.async_save")
    with paused_gc():
        state = training_state(model, optimizer, extra)
    if async_:
        return async_save_state_dict(state, path, **options)
    save_state_dict(state, path, **options)
    return None


def async_save(path: str | os.PathLike, **kwargs: Any) -> Future:
    """``save(path, ..., async_=True)``: returns a ``concurrent.futures.Future`` resolving when committed."""
    future = save(path, async_=True, **kwargs)
    assert future is not None  # an async save returns its future
    return future


def load(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    verify: str = "crc",
    require_manifest: bool = True,
    extra: dict[str, Any] | None = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    no_dist: bool = False,
    storage_options: dict[str, Any] | None = None,
    max_read_bytes: int | None = DEFAULT_MAX_READ_BYTES,
    read_once_per_replica: bool = True,
    rank_local: bool = False,
) -> LoadResult:
    """Load the checkpoint at ``path`` into ``model`` / ``optimizer`` in place; returns the saved ``extra``.

    Any world size and layout. Each rank reads its own part; under an
    initialised process group every rank of ``process_group`` calls it and
    they agree at the end (one small gather): an error on one rank (a damaged
    file only it read) raises on every rank, the others raising
    :class:`~checkpoint.save_errors.CheckpointLoadError`. ``no_dist=True``: a
    rank-local load (one rank alone), no communication. The optimizer's lazy state
    is created first (so parameters that never had a gradient load fine); an
    optimizer with masters (``HybridDeviceOptimizer``, or ``optim.enable_main_params``)
    keeps the masters saved in the checkpoint and rebuilds the others from the
    loaded weights.
    ``strict=False`` skips and reports missing / unexpected / mis-shaped keys
    on the returned dict's ``missing_keys`` / ``unexpected_keys`` / ``mismatched_keys``.
    ``verify`` (``"crc"``, the default: every byte read is checked against the
    manifest's CRC-32s as it streams in | ``"full"`` | ``"sizes"`` | ``"none"``) and ``require_manifest``
    (``False`` reads a plain ``dcp.save`` directory too): see :func:`checkpoint.open_checkpoint`.
    A ``master_param`` saved by ``HybridDeviceOptimizer`` (an fp32 master of a
    bf16 weight) loading into an optimizer that keeps no masters goes into the
    model weight when that is fp32 (the master is the better copy), else is skipped.
    ``extra``: objects saved as ``extra`` values that load in place, as
    ``dcp.load`` does: each Stateful one (``load_state_dict()``: a dataloader,
    a module) is given its saved state; the returned dict holds the object.
    ``max_read_bytes`` (host memory cap of the reads) and ``read_once_per_replica`` (HSDP / DDP replicas
    read once, receive the rest): see :func:`checkpoint.load_state_dict`.
    ``path`` may be a URL (``s3://bucket/prefix``, any fsspec URL; ``storage_options`` go to its file system).
    ``rank_local=True``: ``path`` holds this rank's local shards as whole tensors under the usual keys
    (:func:`rank_local` of the state, as :mod:`checkpoint.tiered` writes them); each is loaded into the
    local shard of its target (a shape that differs is reported by name); no communication.
    """
    path = locate(path, storage_options)
    no_dist = no_dist or rank_local
    options = read_options(
        process_group=process_group,
        no_dist=no_dist,
        max_read_bytes=max_read_bytes,
        read_once_per_replica=read_once_per_replica,
    )
    load = partial(_load, path, model, optimizer, strict, verify, require_manifest, extra, options, rank_local)
    return load_on_every_rank(load, path, process_group=process_group, no_dist=no_dist)


def _load(
    path, model, optimizer, strict, verify, require_manifest, extra, options: ReadOptions, local: bool
) -> LoadResult:
    opened = open_checkpoint(path, verify=verify, require_manifest=require_manifest)
    saved = opened.saved
    targets: dict[str, Any] = {}
    optional: set[str] = set()
    scope: list[str] = []
    ignored: set[str] = set()
    if optimizer is not None and model is None:
        raise ValueError("loading an optimizer needs its model too (state is keyed by parameter names)")
    ties: dict[str, tuple[str, torch.Tensor]] = {}
    if model is not None:
        targets.update({f"model.{k}": v for k, v in model_entries(model).items()})
        scope.append("model.")
        tied_optional, ties = _tied_targets(tied_aliases(model), targets, saved)
        optional |= tied_optional
    options = options.sharing_replicas_of(targets.values())  # the model's mesh: what replicas read once along
    opt_plan = None
    if optimizer is not None:
        opt_plan = _OptimizerLoad(optimizer, model, opened, options)
        targets.update(opt_plan.targets)
        optional |= opt_plan.optional
        ignored = set(opt_plan.unheld_masters)
        scope.append("optimizer.state.")
    extra_targets = _extra_placeholders(opened.saved)
    targets.update(extra_targets)
    if local:
        targets = rank_local(targets)  # views of the same storage: filling them fills the model and optimizer
    try:
        if opt_plan is not None:
            opt_plan.check_saved_state(strict)
        report, values = load_flat(
            opened, targets, strict=strict, optional=optional, scope=tuple(scope), ignored=ignored, options=options
        )
        _check_ties(ties, targets, strict, report)
        if opt_plan is not None:
            _masters_into_weights(opened, opt_plan.unheld_masters, targets, strict, report, options)
    except BaseException:
        if opt_plan is not None:
            opt_plan.abort()
        raise
    if opt_plan is not None:
        opt_plan.finish(values, report)
    saved_extra = _unflatten_extra(opened.planner_paths, extra_targets, values)
    _load_stateful_extra(saved_extra, extra or {}, strict, report)
    return LoadResult(saved_extra, report)


def rank_local(tree: Any) -> Any:
    """``tree`` with every DTensor / flat shard replaced by a plain tensor viewing this rank's local part.

    The result shares storage with ``tree``'s tensors (a load into it fills them in place); it
    carries no shard description, so a save of it writes each local part whole, as a tensor of its own.
    """
    if isinstance(tree, dict):
        return {k: rank_local(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):  # plain ones: a named tuple is rebuilt otherwise
        return type(tree)(rank_local(v) for v in tree)
    if isinstance(tree, CheckpointShard):
        return tree.local.detach()
    if isinstance(tree, torch.Tensor):
        # detach(): a new tensor object, without the fsdp_shard_spec attribute a flat shard carries
        return local_tensor(tree).detach()
    return tree


def _tied_targets(
    aliases: dict[str, str], targets: dict[str, Any], saved
) -> tuple[set[str], dict[str, tuple[str, torch.Tensor]]]:
    """Load the names of one tied tensor through one stored name; the others into scratch, to compare.

    Any stored name satisfies the tie (HF stores the twin only). Where the
    checkpoint stores several, they were maybe not tied when saved: loading
    both into the one tensor would keep whichever came last, silently.
    Changes ``targets``; returns the keys that may be absent and
    ``scratch key -> (loaded key, scratch tensor)``.
    """
    names: dict[str, list[str]] = {}
    for alias, twin in aliases.items():
        names.setdefault(twin, [twin]).append(alias)
    optional: set[str] = set()
    scratch: dict[str, tuple[str, torch.Tensor]] = {}
    for group in names.values():
        stored = [f"model.{n}" for n in group if f"model.{n}" in saved]
        # none stored: the first name is reported missing, once
        optional |= {f"model.{n}" for n in (group if stored else group[1:])}
        for key in stored[1:]:
            target = targets[key]
            copy: torch.Tensor = (
                CheckpointShard(torch.empty_like(target.local), target.spec)
                if isinstance(target, CheckpointShard)
                else torch.empty_like(target)  # a DTensor stays one, with its placements
            )
            targets[key] = copy
            scratch[key] = (stored[0], copy)
    return optional, scratch


def _check_ties(
    ties: dict[str, tuple[str, torch.Tensor]], targets: dict[str, Any], strict: bool, report: LoadReport
) -> None:
    """Saved values of one tied tensor must agree; otherwise the checkpoint's weights were not tied."""
    for key, (loaded, copy) in ties.items():
        if key in report.missing_keys or _skipped(key, report):
            continue
        if not torch.equal(_local_part(copy), _local_part(targets[loaded])):
            problem = (
                f"{key}: differs from {loaded}, which this model ties to it (one tensor); the checkpoint's "
                "weights were not tied: load into a model with untied weights (e.g. tie_word_embeddings=False)"
            )
            if strict:
                raise ValueError(f"{problem}, or pass strict=False to keep {loaded}")
            report.mismatched_keys.append(problem)


def _local_part(t: torch.Tensor) -> torch.Tensor:
    return t.local if isinstance(t, CheckpointShard) else local_tensor(t)


def _load_stateful_extra(saved: dict[str, Any], objects: dict[str, Any], strict: bool, report: LoadReport) -> None:
    """Hand each Stateful in ``objects`` (at any depth of dicts and lists) its state saved at the same place."""
    for name, obj in objects.items():
        if not isinstance(obj, (Stateful, dict, list)):
            raise TypeError(
                f"extra[{name!r}] is a {type(obj).__name__}; only objects with load_state_dict() load in place"
            )
    _, found = resolve_stateful(objects)
    present = []
    for path, obj in found:
        if _element_at(saved, path) is _ABSENT:
            key = ".".join(["extra", *map(str, path)])
            if strict:
                raise ValueError(
                    f"the checkpoint has no {key} to load into {type(obj).__name__}; pass strict=False to skip it"
                )
            report.missing_keys.append(key)
        else:
            present.append((path, obj))
    load_stateful(saved, present)
    for path, obj in reversed(present):  # innermost first: an outer object then replaces its whole subtree
        set_element(saved, path, obj)


_ABSENT = object()


def _element_at(tree: Any, path: StatefulPath) -> Any:
    for part in path:
        in_list = isinstance(tree, list) and isinstance(part, int) and part < len(tree)
        if not (in_list or (isinstance(tree, dict) and part in tree)):
            return _ABSENT
        tree = tree[part]
    return tree


class _OptimizerLoad:
    """The optimizer's share of a load: targets before reading, ``load_state_dict`` after."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, opened: OpenCheckpoint, options: ReadOptions
    ) -> None:
        saved = opened.saved
        self.optimizer = optimizer
        self.saved_keys = saved.keys()  # a view: membership without copying ~15 keys a parameter
        fqns = param_fqns(model)
        self.osd, created = checkpoint_state(optimizer, for_save=False)
        fresh = {fqns[i] for i in created if i in fqns}
        self.entries = optimizer_entries(optimizer, self.osd, fqns)
        # State created here for a parameter the checkpoint has none for is dropped again after the load.
        self.unsaved = _without_saved_state(fresh, self.entries.state, saved)
        self.fresh = fresh
        self.targets: dict[str, Any] = {}
        self.optional: set[str] = set()
        self.state_keys: dict[str, tuple[str, str]] = {}
        # torch's unflattened layout: fqn -> its group's number; read only where asked for (a list of every name)
        numbers = cache(partial(_saved_group_numbers, opened, options))
        self.lost: list[str] = []
        """trained here, in the saved groups, without saved state that the checkpoint says it had"""
        self.unrecorded: list[str] = []
        """trained here, without saved state, in a checkpoint that does not say why (the old behaviour)"""
        asked = self._sort_unsaved(optimizer, opened, options, numbers(), fqns) if self.unsaved else set()
        for fqn, entry in self.entries.state.items():
            if fqn in self.unsaved:
                if fqn in asked:
                    self.targets.update({f"optimizer.state.{fqn}.{name}": None for name in entry})
                continue
            for name, value in entry.items():
                key = _stored_key(fqn, name, saved)
                self.targets[key] = value
                self.state_keys[key] = (fqn, name)
                if name == MASTER_PARAM:
                    self.optional.add(key)  # not stored when equal to the weight; rebuilt from it
        # Saved masters of parameters whose optimizer here keeps none (a plain torch optimizer).
        self.unheld_masters = {
            _stored_key(fqn, MASTER_PARAM, saved): fqn
            for fqn, entry in self.entries.state.items()
            if MASTER_PARAM not in entry and _stored_key(fqn, MASTER_PARAM, saved) in saved
        }
        self.group_keys: list[tuple[int, str, str]] = []
        for g_index, (names, osd_group) in enumerate(zip(self.entries.group_members, self.osd["param_groups"])):
            if not names:
                continue
            for hyper in osd_group:
                if hyper == "params":
                    continue
                # Ours / flattened torch layout first, then torch's unflattened one: the saved group that held
                # this parameter, not the one at this position (groups may be reordered; position only where no
                # saved list names any of them: stale after --stack / --split)
                key = f"optimizer.param_groups.{names[0]}.{hyper}"
                if key not in saved:
                    number = next((numbers()[n] for n in names if n in numbers()), str(g_index))
                    key = f"optimizer.param_groups.{number}.{hyper}"
                if key in saved:
                    self.targets[key] = None
                    self.optional.add(key)
                    self.group_keys.append((g_index, hyper, key))

    def _sort_unsaved(
        self,
        optimizer: torch.optim.Optimizer,
        opened: OpenCheckpoint,
        options: ReadOptions,
        numbers: dict[str, str],
        fqns: dict[int, str],
    ) -> set[str]:
        """Sort the parameters with no saved state (:attr:`unsaved`) trained here into :attr:`lost` and
        :attr:`unrecorded`; return those whose state is asked for all the same (reported missing)."""
        saved = opened.saved
        known = _params_known_to_saved_optimizer(saved, numbers, fqns, _fqns_under("optimizer.state.", saved))
        trainable = {fqns[id(p)] for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        without_state = _saved_without_state(opened, options)  # None: not recorded (older, another tool)
        asked = set()
        for fqn in self.entries.state:
            if fqn not in self.unsaved or fqn not in trainable:
                continue
            if fqn in known and fqn not in (without_state or ()):
                (self.unrecorded if without_state is None else self.lost).append(fqn)
            if fqn not in known or fqn in self.lost:
                # Not in the saved optimizer's groups (e.g. a model-only checkpoint), or its state was
                # lost: resuming would restart its moments from zero.
                asked.add(fqn)
        return asked

    def check_saved_state(self, strict: bool) -> None:
        """Refuse (strict) state lost from the checkpoint; warn of state a checkpoint does not account for."""
        if self.lost and strict:
            raise ValueError(
                f"the checkpoint's optimizer section holds no state for {len(self.lost)} parameter(s) this "
                f"optimizer trains ({some_of(self.lost)}), though they had state when saved (they are not in "
                f"optimizer.{SAVED_WITHOUT_STATE}): it was removed, resuming would restart it from zero; "
                "load a checkpoint that has it, or pass strict=False to start their state fresh"
            )
        if self.unrecorded:
            logger.warning(
                "the checkpoint holds no optimizer state for %d parameter(s) this optimizer trains (%s) and does "
                "not record whether they were saved before their first step (optimizer.%s: written before "
                "2026-11, or by another tool): their state starts fresh",
                len(self.unrecorded),
                some_of(self.unrecorded),
                SAVED_WITHOUT_STATE,
            )

    def abort(self) -> None:
        """Undo the lazy state created for the load: a failed load leaves the optimizer as it was."""
        if self.fresh:
            created = {self.entries.index_of[f] for f in self.fresh}
            state = {i: v for i, v in self.osd["state"].items() if i not in created}
            load_optimizer_state(self.optimizer, {**self.osd, "state": state})

    def finish(self, values: dict[str, Any], report: LoadReport) -> None:
        """Hand the filled state dict to the optimizer. Precondition: the model's weights are loaded."""
        state = self.osd["state"]
        index_of = self.entries.index_of
        for key, (fqn, name) in self.state_keys.items():
            if key in values:
                state[index_of[fqn]][name] = values[key]
            if name == MASTER_PARAM and (key not in self.saved_keys or _skipped(key, report)):
                # Not saved: keep the master reload_model_params() rebuilds from the loaded weight.
                state[index_of[fqn]].pop(MASTER_PARAM, None)
        for fqn in self.unsaved:
            state.pop(index_of[fqn], None)
        for g_index, hyper, key in self.group_keys:
            if key in values:
                self.osd["param_groups"][g_index][hyper] = values[key]
        # A loaded master is the truth (its param becomes its cast); a master not saved is rebuilt
        # from the loaded weight by the optimizer (the next step compares every param with its master).
        load_optimizer_state(self.optimizer, self.osd)


def _stored_key(fqn: str, name: str, saved: dict[str, Any]) -> str:
    """The checkpoint key of state ``name`` of ``fqn``; a master saved under a legacy key is found there."""
    key = f"optimizer.state.{fqn}.{name}"
    if name == MASTER_PARAM and key not in saved:
        for legacy in LEGACY_MASTER_KEYS:  # checkpoints written before the key was unified (2026-11)
            if f"optimizer.state.{fqn}.{legacy}" in saved:
                return f"optimizer.state.{fqn}.{legacy}"
    return key


def _masters_into_weights(
    opened, masters: dict[str, str], targets: dict[str, Any], strict: bool, report: LoadReport, options: ReadOptions
) -> None:
    """Saved fp32 masters for an optimizer that keeps none: the better copy of an fp32 weight.

    Loaded over an fp32 model weight after the weights (the saved weight may be
    its bf16 cast); skipped for a low-precision weight, which the saved weight
    already is (the master rounded).
    """
    into = {}
    for key, fqn in masters.items():
        weight = targets.get(f"model.{fqn}")
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            into[key] = weight
    if into:
        sub_report, _ = load_flat(opened, into, strict=strict, scope=(), options=options)
        report.mismatched_keys += sub_report.mismatched_keys


_GROUP_PARAMS = re.compile(r"optimizer\.param_groups\.([0-9]+)\.params\Z")


def _saved_group_numbers(opened: OpenCheckpoint, options: ReadOptions) -> dict[str, str]:
    """fqn -> the number of its saved group, from torch's unflattened layout (``param_groups.<n>.params``)."""
    # endswith first: a C call per key, where the regex's match costs ~4x that on each of ~15 keys a parameter
    saved = opened.saved
    numbers = {k: m.group(1) for k in saved if k.endswith(".params") and (m := _GROUP_PARAMS.match(k))}
    if not numbers:
        return {}
    _, values = load_flat(opened, dict.fromkeys(numbers), strict=False, scope=(), options=options)
    return {fqn: numbers[key] for key, names in values.items() for fqn in names or ()}


def _saved_without_state(opened: OpenCheckpoint, options: ReadOptions) -> set[str] | None:
    """The FQNs the save recorded as having no optimizer state; ``None`` where it recorded nothing."""
    key = f"optimizer.{SAVED_WITHOUT_STATE}"
    if key not in opened.saved:
        return None
    _, values = load_flat(opened, {key: None}, strict=False, scope=(), options=options)
    return set(values.get(key) or ())


def _without_saved_state(fqns: set[str], state: dict[str, dict[str, Any]], saved: dict[str, Any]) -> set[str]:
    """The names of ``fqns`` with no key ``optimizer.state.<fqn>.<name>`` in ``saved``.

    Looked up under the names of their ``state`` here (a resume: the same optimizer); a pass over every
    saved key only for those not found so (another optimizer's state names, or none saved).
    """
    unsure = [
        fqn
        for fqn in fqns
        if not any(f"optimizer.state.{fqn}.{name}" in saved for name in state.get(fqn, ()) if "." not in name)
    ]
    if not unsure:
        return set()
    with_state = _fqns_under("optimizer.state.", saved)
    return {fqn for fqn in unsure if fqn not in with_state}


def _fqns_under(prefix: str, saved: dict[str, Any]) -> set[str]:
    """The parameter names of the keys ``<prefix><fqn>.<name>`` in ``saved``."""
    return {k[len(prefix) :].rsplit(".", 1)[0] for k in saved if k.startswith(prefix)}


def _params_known_to_saved_optimizer(
    saved: dict[str, Any], numbers: dict[str, str], fqns: dict[int, str], with_state: set[str]
) -> set[str]:
    """The FQNs the saved optimizer held: with state (``with_state``, those under ``optimizer.state.``), or
    in a saved param group.

    A parameter in a saved group but without state never had a gradient (lazy
    state): it loads as "no state". Torch's unflattened layout names a group's
    parameters in ``param_groups.<number>.params`` (``numbers``); a layout with
    group numbers but no such lists names none, so every parameter counts as known.
    """
    grouped = _fqns_under("optimizer.param_groups.", saved)
    named = {name for name in grouped if not name.isdigit()}
    if grouped and not named and not numbers:
        return set(fqns.values())
    return with_state | named | set(numbers)


def _skipped(key: str, report: LoadReport) -> bool:
    return key in report.missing_keys or any(m.startswith(f"{key}:") for m in report.mismatched_keys)


def _extra_placeholders(saved: dict[str, Any]) -> dict[str, Any]:
    """Targets for every saved ``extra.*`` key: empty tensors of the saved shape, ``None`` for other values."""
    targets: dict[str, Any] = {}
    for key, item in saved.items():
        if key.startswith("extra."):
            if isinstance(item, TensorStorageMetadata):
                targets[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
            else:
                targets[key] = None
    return targets


def _unflatten_extra(paths: dict[str, tuple], targets: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The nested ``extra`` dict as saved (DCP's planner data, ``paths``, maps each dotted key back to its path)."""
    nested: dict[str, Any] = {}
    for key, target in targets.items():
        value = values.get(key, target)
        path = key_path(key, paths)
        if path[0] != "extra":
            # written by a tool that recorded no nesting (fsdp-ckpt reshard before 2026-11: (key,))
            path = key_path(key)
        set_element(nested, path, value)
    return nested.get("extra", {})
