"""One instance of an ordinary optimizer class over many records' working tensors.

Used for the device share (``gpu_optimizer_cls`` updating the local params, or
their fp32 masters, directly) and for host buckets whose class has no bucketed
fused kernel (``cpu_optimizer_cls`` over the bucket's master views). Either way
it is ONE optimizer object for many parameters, with one param group per
wrapper group so hyper-parameters keep their grouping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from offload_fsdp.defaults import class_defaults, hyperparameters
from offload_fsdp.fresh_state import create_fresh_state
from offload_fsdp.master import MASTER_KEY
from offload_fsdp.records import ParamShard

__all__ = ["DelegatedOptimizer", "hyperparameters"]

GroupView = Callable[[int, dict[str, Any]], dict[str, Any]]
"""(wrapper group index, wrapper group) -> the hyper-parameters the inner class gets"""


def _same_hyperparameters(index: int, group: dict[str, Any]) -> dict[str, Any]:
    return hyperparameters(group)


def _inner_groups(
    records: list[ParamShard], groups: list[dict[str, Any]], view: GroupView
) -> tuple[list[int], list[dict[str, Any]]]:
    """(wrapper group indices, one inner group each over the records' ``working`` tensors), in group order."""
    by_group: dict[int, list[ParamShard]] = {}
    for r in records:
        by_group.setdefault(r.group_index, []).append(r)
    indices = sorted(by_group)
    return indices, [{**view(g, groups[g]), "params": [r.working_tensor for r in by_group[g]]} for g in indices]


class DelegatedOptimizer:
    """``cls`` over the ``working`` tensors of ``records``; groups mirror the wrapper's groups.

    Preconditions: every record has ``working`` set (a plain tensor). The caller
    sets ``working.grad`` before :meth:`step` and clears it after. ``view`` maps a
    wrapper group to the inner group's hyper-parameters (default: all of them as
    they are; a device class other than the host class gets
    :meth:`offload_fsdp.defaults.DeviceDefaults.for_device`).
    """

    def __init__(
        self,
        cls: type[torch.optim.Optimizer],
        records: list[ParamShard],
        groups: list[dict[str, Any]],
        *,
        where: str,
        view: GroupView | None = None,
    ) -> None:
        self.cls, self.where = cls, where
        self.view = view if view is not None else _same_hyperparameters
        self.group_indices, inner_groups = _inner_groups(records, groups, self.view)
        try:
            # torch.optim subclasses take (params, **hyper-parameters); only the base takes defaults=
            self.inner = cls(inner_groups)  # type: ignore[call-arg]
        except Exception as exc:  # noqa: BLE001 - re-raised with what the user can change
            raise self._unsupported(exc) from exc
        # torch's Adagrad creates its state in __init__, from its constructor's keywords, not the groups'.
        self.init_creates_state = bool(self.inner.state)
        self._state_from_group_values(inner_groups)
        self.records = list(records)

    def add_records(self, records: list[ParamShard], groups: list[dict[str, Any]]) -> None:
        """Take over ``records`` of wrapper groups not served yet (a group added later): new inner groups."""
        indices, inner_groups = _inner_groups(records, groups, self.view)
        assert not set(indices) & set(self.group_indices), "each wrapper group maps to one inner group"
        try:
            for inner_group in inner_groups:
                self.inner.add_param_group(inner_group)
            self._state_from_group_values(self.inner.param_groups[-len(inner_groups) :])
        except Exception as exc:  # noqa: BLE001 - re-raised with what the user can change
            raise self._unsupported(exc) from exc
        self.group_indices += indices
        self.records += records

    def _state_from_group_values(self, inner_groups: list[dict[str, Any]]) -> None:
        """For a class that creates state in ``__init__`` (torch's Adagrad: ``sum`` at its constructor's
        ``initial_accumulator_value``): that state again, per group, built with the group's own values."""
        if not self.init_creates_state:
            return
        keywords = set(class_defaults(self.cls))
        for group in inner_groups:
            hyper = {k: v for k, v in hyperparameters(group).items() if k in keywords}
            made = self.cls(group["params"], **hyper)
            for p in group["params"]:
                self.inner.state[p] = made.state[p]

    def _unsupported(self, exc: Exception) -> TypeError:
        return TypeError(
            f"{self.cls.__name__} could not be built over {self.where} tensors ({exc}); "
            f"pass a {'cpu' if self.where == 'host' else 'gpu'}_optimizer_cls that supports them"
        )

    def sync_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        """Copy the wrapper's current hyper-parameters (lr, betas, ...) into the inner groups."""
        for inner_group, g in zip(self.inner.param_groups, self.group_indices):
            inner_group.update(self.view(g, groups[g]))

    def step(self, groups: list[dict[str, Any]]) -> None:
        """Run the inner step with the wrapper's hyper-parameters, then expose any new state.

        A record with placeholder state that is stepped now (has a grad) first drops it,
        so the class creates its first-step state itself, exactly as torch's would.
        """
        self.sync_hyperparameters(groups)
        stepped = {id(r) for r in self.records if r.working_tensor.grad is not None}
        for r in self.records:
            if r.placeholder_state and id(r) in stepped:
                self.inner.state.pop(r.working_tensor, None)
                r.placeholder_state = False
        self.step_inner_only()
        self.expose(self.records, stepped)

    def expose(self, records: list[ParamShard], fresh: set[int] | None = None) -> None:
        """(Re)build each record's public state from the inner state, sharing its storage.

        ``fresh``: ids of records just stepped or materialised (default: all of ``records``). A
        class keeping no state of its own (SGD without momentum) leaves their inner state empty,
        but a separate master is state all the same: exposed, so it is saved and loaded.
        """
        for r in records:
            inner = self.inner.state.get(r.working_tensor) or {}
            if not inner and not (r.has_separate_master and (r.state is not None or fresh is None or id(r) in fresh)):
                continue
            public = r.state if r.state is not None else {}
            for k, v in inner.items():
                if not isinstance(v, torch.Tensor):
                    public[k] = v
                elif (
                    k not in public
                    or not isinstance(public[k], torch.Tensor)
                    or public[k].data_ptr() != v.data_ptr()
                    or public[k].shape != v.shape
                ):
                    public[k] = r.wrap(v)
            if r.has_separate_master and MASTER_KEY not in public:
                public[MASTER_KEY] = r.wrap(r.working_tensor)
            r.state, r.inner_state = public, inner

    def forget(self, record: ParamShard) -> None:
        """Drop ``record``'s state, so its next step starts fresh as in torch."""
        self.inner.state.pop(record.working_tensor, None)
        record.state = record.inner_state = None
        record.placeholder_state = False

    def materialize(self, records: list[ParamShard], groups: list[dict[str, Any]]) -> None:
        """Create the inner state of ``records`` without changing them: the class's fresh state
        (:func:`offload_fsdp.fresh_state.create_fresh_state`), to load into.

        Marked ``placeholder_state``: stepped without a load, a record drops it and the class
        creates its first-step state itself (:meth:`step`), which matters for a class whose
        fresh state could only be zero-filled.
        """
        if not records:
            return
        self.sync_hyperparameters(groups)
        working = [r.working_tensor for r in records]
        self._on_host_or_type_error(lambda: create_fresh_state(self.inner, working))
        for r in records:
            r.placeholder_state = True
        self.expose(records)

    def step_inner_only(self) -> None:
        """``inner.step()``, turning a host-incompatible class's failure into a TypeError that says so."""
        self._on_host_or_type_error(self.inner.step)

    def _on_host_or_type_error(self, run: Callable[[], Any]) -> None:
        try:
            run()
        except (RuntimeError, NotImplementedError) as exc:
            if self.where != "host":
                raise
            raise TypeError(
                f"{self.cls.__name__} cannot run on host (CPU) tensors: {exc}. Pass cpu_optimizer_cls= "
                "a class that runs on the CPU (e.g. torch.optim.AdamW)"
            ) from exc
