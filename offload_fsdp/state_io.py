"""Loading a torch-convention optimizer state dict into records' existing tensors, in place.

The optimizer's state tensors are views of flat host buckets (or a delegated
optimizer's own tensors), so a load must *copy into* them, never replace them:
the next step keeps using the same storage. Values may arrive as DTensors (from
``torch.distributed.checkpoint.state_dict.set_state_dict``) or plain tensors, in
any dtype (``copy_`` converts: fp32 moments load into bf16 host moments).
"""

from __future__ import annotations

from typing import Any

import torch

from offload_fsdp.defaults import class_defaults
from offload_fsdp.grad import local_tensor
from offload_fsdp.master import MASTER_KEY
from offload_fsdp.records import ParamShard

__all__ = ["check_groups_fit_class", "check_groups_match", "check_record_state", "load_record_state"]


def check_groups_match(ours: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """Raise ``ValueError`` unless the saved groups have our group count and per-group param counts."""
    if len(saved) != len(ours):
        raise ValueError(
            f"loaded state dict has {len(saved)} parameter groups, this optimizer has {len(ours)}; "
            "build the optimizer with the same groups as the one saved"
        )
    for i, (a, b) in enumerate(zip(ours, saved)):
        if len(a["params"]) != len(b["params"]):
            raise ValueError(
                f"parameter group {i} has {len(a['params'])} params but the loaded group has "
                f"{len(b['params'])}; build the optimizer with the same groups as the one saved"
            )


def check_groups_fit_class(
    cls: type[torch.optim.Optimizer], ours: list[dict[str, Any]], saved: list[dict[str, Any]]
) -> None:
    """Raise ``ValueError`` when a saved group lacks a hyper-parameter ``cls`` reads (saved by another class).

    torch's ``load_state_dict`` takes such a group and its next step raises ``KeyError``
    (AdamW given SGD's groups: ``'betas'``). Keys the class's ``__setstate__`` fills in
    (those older torch versions did not save, e.g. ``decoupled_weight_decay``) are not missing.
    """
    hyper = set(class_defaults(cls))
    for index, (group, theirs) in enumerate(zip(ours, saved)):
        probe = cls.__new__(cls)
        # The class's own unpickling: what torch's load_state_dict runs to complete an older group.
        probe.__setstate__({"defaults": {}, "state": {}, "param_groups": [{**theirs, "params": []}]})
        missing = sorted((hyper & set(group)) - set(probe.param_groups[0]))
        if missing:
            extra = sorted(set(theirs) - set(group) - {"params", "param_names"})
            raise ValueError(
                f"loaded param group {index} has no {missing}, which {cls.__name__} reads at every step"
                + (f" (and has {extra}, which it does not)" if extra else "")
                + f"; was the state dict saved by another optimizer class? Load one saved by {cls.__name__}"
            )


def check_record_state(r: ParamShard, saved: dict[str, Any], class_name: str) -> None:
    """Raise ``ValueError`` naming the param and key unless ``saved`` fits ``r``'s materialised state.

    Changes nothing: a load checks every param first, so a failed load leaves the optimizer as it was.
    """
    assert r.working is not None  # materialised before any load
    expected = set(r.state or ()) - {MASTER_KEY}  # None: the class keeps no state with these options
    got = set(saved) - {MASTER_KEY}
    if got and expected != got:  # none at all (a master only): never updated, as state_dict() leaves it
        raise ValueError(
            f"optimizer state of parameter {r.name!r} has keys {sorted(got)}, expected {sorted(expected)} "
            f"({class_name}); was it saved with another optimizer class or options (e.g. amsgrad)?"
        )
    for key, value in saved.items():
        if key == MASTER_KEY:
            if value is not None and r.has_separate_master and local_tensor(value).shape != r.working.shape:
                raise ValueError(
                    f"{MASTER_KEY} of parameter {r.name!r} has local shape {tuple(local_tensor(value).shape)}, "
                    f"expected {tuple(r.working.shape)}"
                )
            continue
        assert r.state is not None  # it holds ``key``: the keys matched
        dst = r.state[key]
        if not isinstance(dst, torch.Tensor):
            continue
        src = local_tensor(value) if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if src.shape != local_tensor(dst).shape:
            raise ValueError(
                f"optimizer state {key!r} of parameter {r.name!r} has local shape {tuple(src.shape)}, "
                f"expected {tuple(local_tensor(dst).shape)}; load through checkpoint.load to reshard"
            )


def load_record_state(r: ParamShard, saved: dict[str, Any], class_name: str) -> None:
    """Copy ``saved`` (one param's state) into ``r``'s materialised state; then its master, if saved.

    Preconditions: ``r.state`` exists (materialised) and ``saved`` uses the master key
    :data:`~offload_fsdp.master.MASTER_KEY` (:func:`~offload_fsdp.master.canonical_state`).
    Side effects: state tensors, the master and (when one is loaded) the param itself, set to
    the master's cast (one blocking host-to-device copy); the master is then no upcast of the param.
    """
    check_record_state(r, saved, class_name)
    if set(saved) - {MASTER_KEY}:
        r.placeholder_state = False  # loaded: the state is real from here on
    for key, value in saved.items():
        if key != MASTER_KEY:
            _load_value(r, key, value)
    master = saved.get(MASTER_KEY)
    if master is not None and r.has_separate_master:
        _load_master(r, local_tensor(master))


def _load_value(r: ParamShard, key: str, value: Any) -> None:
    assert r.state is not None  # materialised before any load
    dst = r.state[key]
    if not isinstance(dst, torch.Tensor):  # a plain number kept by some optimizer classes
        r.state[key] = value
        if r.inner_state is not None:
            r.inner_state[key] = value
        return
    src = local_tensor(value) if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    local_tensor(dst).copy_(src)


def _load_master(r: ParamShard, src: torch.Tensor) -> None:
    assert r.working is not None  # a record with a separate master
    r.working.copy_(src)
    if r.offloaded:
        assert r.param_stage is not None  # an offloaded separate master is cast through its staging
        r.param_stage.copy_(r.working)
        r.local.copy_(r.param_stage)  # blocking H2D: the param is the master's cast
    else:
        r.local.copy_(r.working)
    r.mark_synced()  # agree now (and the master may hold more than the param: a checkpoint keeps it)
