"""What a model and an optimizer contribute to a checkpoint, keyed like ``torch.distributed.checkpoint.state_dict``.

Keys (after DCP's dotted flattening):

* ``model.<fqn>``: every entry of ``model.state_dict()`` (FSDP2 gives sharded
  DTensors; flat-shard params are recognised by their ``fsdp_shard_spec``);
* ``optimizer.state.<fqn>.<name>``: optimizer state per parameter FQN (never
  parameter ids), e.g. ``exp_avg``, ``exp_avg_sq``, ``step``;
* ``optimizer.param_groups.<fqn>.<key>``: each parameter's group
  hyper-parameters (the layout of ``get_state_dict`` with
  ``flatten_optimizer_state_dict=True``), without ``param_names`` (a list of
  every name, once per parameter, would make the state grow with N^2);
* ``optimizer.param_groups.<index>.<key>`` and ``...<index>.params``: the same
  options once per group, ``param_names`` included, in torch's unflattened
  layout (``get_state_dict``'s default), so plain ``dcp.load`` reads either;
* ``optimizer.saved_without_state``: the FQNs of the optimizer's parameters that
  had no state when saved (before their first step, or an optimizer keeping
  none), one list: a strict load tells them from state that was lost.

``master_param`` (the fp32 master of a low-precision parameter) is stored only
when it carries information the saved weight does not: the optimizer decides
(``checkpoint_state(for_save=True)``, :mod:`offload_fsdp.fresh_state`), leaving out
a master it knows to be exactly its weight widened, which a load rebuilds from the weight.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from checkpoint.shard import CheckpointShard
from offload_fsdp.master import LEGACY_MASTER_KEYS, MASTER_KEY
from offload_fsdp.shard_spec import shard_spec_of

__all__ = [
    "LEGACY_MASTER_KEYS",
    "MASTER_PARAM",
    "PARAM_NAMES",
    "SAVED_WITHOUT_STATE",
    "TIED_SECTION",
    "OptimizerEntries",
    "clean_fqn",
    "key_path",
    "load_optimizer_state",
    "model_entries",
    "optimizer_entries",
    "param_fqns",
    "tied_aliases",
    "unasked_group_layout",
]

MASTER_PARAM = MASTER_KEY
PARAM_NAMES = "param_names"
SAVED_WITHOUT_STATE = "saved_without_state"
"""``optimizer.saved_without_state``: the FQNs saved with no optimizer state (absent before 2026-11)."""
_NUMBERED_GROUP_KEY = re.compile(r"[0-9]+\.[^.]+\Z")
"""what follows ``<section>.param_groups.`` in torch's unflattened layout: ``<group number>.<option>``"""
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    """Drop the names wrappers insert (``torch.compile``, activation checkpointing), as torch's ``get_state_dict`` does."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def key_path(key: str, saved_paths: dict[str, tuple] | None = None) -> tuple:
    """The nested-dict path of a dotted checkpoint key, as DCP's ``planner_data`` records it.

    ``saved_paths`` (a source checkpoint's ``planner_data``) wins where it has
    ``key``; otherwise the path follows the layout ``checkpoint.save`` writes:
    ``model.<fqn>`` -> ``("model", fqn)``, ``optimizer.state.<fqn>.<name>`` ->
    ``("optimizer", "state", fqn, name)`` (``param_groups`` alike), and any
    other key (``extra.*``) split at every dot.
    """
    path = (saved_paths or {}).get(key)
    if path:
        return tuple(path)
    if key.startswith("model."):
        return ("model", key[len("model.") :])
    for section in ("state", "param_groups"):
        prefix = f"optimizer.{section}."
        fqn, dot, name = key[len(prefix) :].rpartition(".")
        if key.startswith(prefix) and dot and fqn:
            return ("optimizer", section, fqn, name)
    return tuple(key.split("."))


def unasked_group_layout(saved: Iterable[str], asked: Collection[str]) -> set[str]:
    """The keys of ``saved`` that a load of the flat keys ``asked`` reads in another form: an optimizer's
    param groups in the torch layout it does not ask for, and ``<section>.saved_without_state``.

    :func:`checkpoint.save` stores each group's options in both of torch's layouts (``get_state_dict``'s
    default one, ``<section>.param_groups.<number>.<option>``, and the flattened one,
    ``<section>.param_groups.<fqn>.<option>``); a section asked for in one layout only reads the same options
    there, so the other's keys are not unexpected. A section asked for in both, or in neither, ignores none.
    """
    layouts: dict[str, set[bool]] = {}  # "<section>.param_groups." -> numbered? of the keys asked for
    for key in asked:
        section, found, rest = key.partition(".param_groups.")
        if found and "." not in section:
            layouts.setdefault(f"{section}{found}", set()).add(bool(_NUMBERED_GROUP_KEY.match(rest)))
    one_layout = {prefix: numbered for prefix, (numbered, *others) in layouts.items() if not others}
    if not one_layout:
        return set()
    bookkeeping = {f"{prefix.removesuffix('param_groups.')}{SAVED_WITHOUT_STATE}" for prefix in one_layout}
    ignored = {key for key in bookkeeping if key not in asked}
    prefixes = tuple(one_layout)
    for key in saved:
        if key.startswith(prefixes) and key not in asked:
            prefix = key[: key.index(".param_groups.") + len(".param_groups.")]
            if bool(_NUMBERED_GROUP_KEY.match(key, len(prefix))) != one_layout[prefix]:
                ignored.add(key)
    return ignored


def _module(model: torch.nn.Module) -> torch.nn.Module:
    # DDP's "module." prefix is not part of the model's names.
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def param_fqns(model: torch.nn.Module) -> dict[int, str]:
    """``id(param) -> fqn`` (the first name of a tied parameter)."""
    names: dict[int, str] = {}
    for name, p in _module(model).named_parameters():
        names.setdefault(id(p), clean_fqn(name))
    return names


TIED_SECTION = "model_tied"
"""Top-level section ``model_tied.<alias fqn>`` -> twin fqn: the model's tied weights, as saved."""


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``alias fqn -> twin fqn`` for every parameter listed under a second name (tied weights).

    The twin is the first name ``named_parameters()`` gives it (GPT-2:
    ``lm_head.weight`` -> ``transformer.wte.weight``).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in _module(model).named_parameters(remove_duplicate=False):
        fqn = clean_fqn(name)
        twin = first.setdefault(id(p), fqn)
        if twin != fqn:
            aliases[fqn] = twin
    return aliases


def model_entries(model: torch.nn.Module) -> dict[str, Any]:
    """``fqn -> tensor`` sharing storage with the model, so loading into it writes the model in place."""
    module = _module(model)
    specs = {clean_fqn(n): shard_spec_of(p) for n, p in module.named_parameters()}
    entries: dict[str, Any] = {}
    for name, value in module.state_dict().items():
        fqn = clean_fqn(name)
        spec = specs.get(fqn)
        if spec is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = CheckpointShard(value, spec)  # state_dict() detaches, dropping the param's attribute
        entries[fqn] = value
    return entries


def _params_in_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class OptimizerEntries:
    """An optimizer's checkpoint entries, keyed by parameter FQN, and where they live in its state dict."""

    state: dict[str, dict[str, Any]]
    """fqn -> state name -> value (the very tensors of the optimizer's state dict)"""
    param_groups: dict[str, dict[str, Any]]
    """fqn -> its group's hyper-parameters"""
    index_of: dict[str, Any]
    """fqn -> the parameter's key in ``state_dict()["state"]``"""
    group_members: list[list[str]]
    """per param group, the FQNs of its parameters"""
    indexed_groups: dict[str, dict[str, Any]]
    """str(group index) -> its options and ``params`` (FQNs): torch's unflattened layout"""

    def without_state(self) -> list[str]:
        """The FQNs of the optimizer's parameters with no state entry (never stepped, or none kept)."""
        return [fqn for names in self.group_members for fqn in names if not self.state.get(fqn)]


def optimizer_entries(optimizer: torch.optim.Optimizer, osd: dict[str, Any], fqns: dict[int, str]) -> OptimizerEntries:
    """Entries built from ``osd`` (torch convention: params numbered across groups), the state dict
    :func:`offload_fsdp.fresh_state.checkpoint_state` gives for a save or a load.

    Tensors are the very tensors of ``osd`` (so a load fills them in place),
    wrapped as shards where the parameter is a flat / box shard.
    """
    params = _params_in_order(optimizer)
    index_to_param: dict[Any, torch.Tensor] = {}
    members: list[list[str]] = []
    position = 0
    for osd_group in osd["param_groups"]:
        names = []
        for index in osd_group["params"]:
            param = params[position]
            position += 1
            if id(param) not in fqns:
                raise ValueError(
                    f"an optimizer parameter of shape {tuple(param.shape)} is not a parameter of the model; "
                    "pass the model whose parameters the optimizer updates"
                )
            index_to_param[index] = param
            names.append(fqns[id(param)])
        members.append(names)
    state: dict[str, dict[str, Any]] = {}
    index_of: dict[str, Any] = {}
    for index, param in index_to_param.items():
        index_of[fqns[id(param)]] = index
    for index, param_state in osd["state"].items():
        param = index_to_param[index]
        fqn = fqns[id(param)]
        spec = shard_spec_of(param)
        entry = {}
        for name, value in param_state.items():
            if spec is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                if value.shape == param.shape:
                    value = CheckpointShard(value, spec)
            entry[name] = value
        state[fqn] = entry
    groups: dict[str, dict[str, Any]] = {}
    indexed: dict[str, dict[str, Any]] = {}
    for g_index, (names, osd_group) in enumerate(zip(members, osd["param_groups"])):
        # Per parameter, without param_names: that list repeated for every parameter grows with N^2.
        hyper = {k: v for k, v in osd_group.items() if k not in ("params", PARAM_NAMES)}
        for fqn in names:
            groups[fqn] = hyper  # one dict per group, shared: a save walks and pickles it once (read only)
        # Once per group: what get_state_dict's default (unflattened) layout asks dcp.load for.
        indexed[str(g_index)] = {**{k: v for k, v in osd_group.items() if k != "params"}, "params": list(names)}
    return OptimizerEntries(state, groups, index_of, members, indexed)


def load_optimizer_state(optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(osd)``, as torch runs it (hooks, casting, checks), in time linear in the params.

    torch's ``Optimizer.load_state_dict`` asks, for every state tensor, which saved group holds its
    param id (``param_id in group["params"]``, in ``_process_value_according_to_param_policy``): a
    scan of the group's id list, so loading N params costs O(N^2) (~0.6 ms a param at 30,000). A
    pre-hook registered last, so it sees the dict the user's hooks return, hands torch each group's
    ids as a list whose ``in`` is a set lookup; nothing else changes.
    """
    handle = optimizer.register_load_state_dict_pre_hook(_ids_with_set_lookup)
    try:
        optimizer.load_state_dict(osd)
    finally:
        handle.remove()


def _ids_with_set_lookup(optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> dict[str, Any]:
    groups = [{**group, "params": _IdList(group["params"])} for group in osd["param_groups"]]
    return {**osd, "param_groups": groups}


class _IdList(list):
    """A saved group's param ids whose ``in`` is a set lookup (built once: no hook runs after the one that
    makes it, and torch only reads it); its deep copy (torch's copy of the groups) is a plain list."""

    def __init__(self, ids: list[Any]) -> None:
        super().__init__(ids)
        self._members = frozenset(ids)

    def __contains__(self, value: object) -> bool:
        return value in self._members

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return copy.deepcopy(list(self), memo)
