"""Let a stock ``torch.optim`` optimizer honour main params and decoupled gradients.

``torch.optim`` reads ``param.grad`` and updates ``param`` in its own dtype. A
bf16 parameter whose fp32 gradient lives in ``param.decoupled_grad`` (see
:mod:`offload_fsdp.grad`) therefore cannot be stepped as is: ``.grad`` is empty, and
an update applied in bf16 would drop everything below bf16's resolution.

:func:`enable_main_params` fixes that with the optimizer's own hooks, keeping
the optimizer a real ``torch.optim`` object of its own class whose ``param_groups``
hold the model's parameters (so LR schedulers and ``get_state_dict`` work):

* before ``step``, every parameter with a gradient that has a master (:mod:`offload_fsdp.master`:
  which params get one, in what dtype) is replaced, in its param group and as the key of its
  state, by that master presented like the param (a DTensor for a DTensor param), whose
  ``.grad`` is the gradient from :func:`~offload_fsdp.grad.get_grad` (cast to the main dtype
  only if it is not already in it). The master is the param's local shard in
  ``main_params_dtype``, kept in a :class:`~offload_fsdp.records.ParamShard` record as
  ``HybridDeviceOptimizer`` keeps its own, and in the optimizer state under ``"master_param"``
  (state saved under the old key ``"main_param"`` loads as it). A param written since the last
  step (a weight load, an in-place edit through the param or its ``to_local()``: a version
  counter moved) is adopted into its master first;
* after ``step``, the param is put back in its group with its state, and the updated master
  is cast into the param's own local shard;
* ``optimizer.zero_grad`` also clears ``decoupled_grad``. torch.optim has no
  zero_grad hook, so the method is shadowed on the instance (the class is
  untouched, and ``state_dict`` never holds methods).

Adam's moments are then created in the main dtype too. Parameters already in
the main dtype with a gradient of that dtype in ``decoupled_grad`` only get
``.grad`` aliased to it for the step. ``load_state_dict`` keeps the saved dtypes
of these parameters' state (torch would otherwise cast it to the bf16 param dtype)
and sets each param with a loaded master to the master's cast.
``optimizer.checkpoint_state`` (also on the instance) gives ``checkpoint.load`` a
master to load into for every param that needs one.

Not CUDA-graph safe (the swap happens in Python around the step); use
``backend="te"`` for graphs with decoupled gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from offload_fsdp.fresh_state import create_fresh_state
from offload_fsdp.grad import get_grad, local_tensor, zero_decoupled_grad
from offload_fsdp.master import MASTER_KEY, adopt_written, canonical_state, has_master
from offload_fsdp.records import ParamShard, param_name

__all__ = ["enable_main_params"]

_HOOKS_ATTR = "_optim_main_params_hooks"


class _MainParamsHooks:
    """The step / load hooks of one optimizer, and what must be undone after the current step.

    A param with a master has a :class:`~offload_fsdp.records.ParamShard` record, as in
    ``HybridDeviceOptimizer``: ``working`` is the master of its local shard (a plain tensor),
    and the record's version keys say when the user wrote the param (through a DTensor or
    through ``to_local()``). For the step the optimizer's group holds the master presented like
    the param (:meth:`ParamShard.wrap`: a DTensor for a DTensor param) in the param's place,
    with the param's state: setting ``.data`` cannot change a DTensor's local tensor.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, main_dtype: torch.dtype | None) -> None:
        self.optimizer = optimizer
        self.main_dtype = main_dtype
        # id(param) -> its record, for params with a master. Keyed by id: the optimizer's
        # param_groups hold every param, so an id is never reused.
        self._records: dict[int, ParamShard] = {}
        # What the current step swapped: (group, position, param, master presented like it), and
        # (param, the .grad to restore) where only .grad was aliased.
        self._swapped: list[tuple[dict[str, Any], int, torch.Tensor, torch.Tensor]] = []
        self._aliased: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._incoming_state: dict[Any, dict[str, Any]] | None = None
        self._incoming_groups: list[dict[str, Any]] | None = None
        self._own_zero_grad = optimizer.zero_grad  # the class's, or an instance override made before ours

    def register(self) -> list[RemovableHandle]:
        opt = self.optimizer
        # torch.optim has no zero_grad hook: shadow the method on this instance only (as torch's
        # LR schedulers do with step), so the class, isinstance and state_dict stay torch's own.
        opt.zero_grad = self.zero_grad  # type: ignore[method-assign]
        opt.checkpoint_state = self.checkpoint_state  # type: ignore[attr-defined]
        return [
            opt.register_step_pre_hook(self.before_step),
            opt.register_step_post_hook(self.after_step),
            opt.register_load_state_dict_pre_hook(self.before_load),
            opt.register_load_state_dict_post_hook(self.after_load),
        ]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's own ``zero_grad`` (``.grad``), then the same for every param's ``decoupled_grad``."""
        self._own_zero_grad(set_to_none=set_to_none)
        params = (param for group in self.optimizer.param_groups for param in group["params"])
        zero_decoupled_grad(params, set_to_none=set_to_none)

    def _record(self, param: torch.Tensor, group_index: int, position: int) -> ParamShard:
        """The record of ``param`` (a param with a master), created on first use."""
        record = self._records.get(id(param))
        if record is None:
            group = self.optimizer.param_groups[group_index]
            name = param_name(group, group_index, position)
            record = ParamShard(param=param, name=name, group_index=group_index)
            self._records[id(param)] = record
        return record

    @torch.no_grad()
    def _master_of(self, record: ParamShard) -> torch.Tensor:
        """The record's master, presented like its param; created as the param's exact upcast on first use,
        and adopting what the user wrote into the param since the optimizer last wrote it."""
        assert self.main_dtype is not None  # has_master said this param has one
        if record.working is None:
            record.working = record.local.to(self.main_dtype, copy=True)
            record.mark_synced(master_is_upcast=True)
        elif record.written_since_sync:
            adopt_written(record.working, record.local)  # the user's weights are the truth
            record.mark_synced()
        return record.wrap(record.working)

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        assert not self._swapped and not self._aliased, "step hooks re-entered: a previous step did not finish"
        for group_index, group in enumerate(optimizer.param_groups):
            for position, param in enumerate(group["params"]):
                grad = get_grad(param)
                if grad is None:
                    continue
                if not has_master(param.dtype, self.main_dtype):
                    # The param is its own main copy (fp32, or wider); only .grad may need aliasing.
                    if grad is not param.grad:  # e.g. an fp32 decoupled grad of an fp32 param
                        self._aliased.append((param, param.grad))
                        param.grad = grad.to(param.dtype)
                    continue
                self._swap_in_master(group, position, self._record(param, group_index, position), grad)

    def _swap_in_master(self, group: dict[str, Any], position: int, record: ParamShard, grad: torch.Tensor) -> None:
        param, master = record.param, self._master_of(record)
        master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        state = self.optimizer.state
        if param in state:
            state[master] = state.pop(param)
        group["params"][position] = master
        self._swapped.append((group, position, param, master))

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        swapped, self._swapped = self._swapped, []
        aliased, self._aliased = self._aliased, []
        for group, position, param, master in swapped:
            group["params"][position] = param
            master.grad = None
            state = optimizer.state.pop(master, {})
            # Stored after the step so torch's lazy state init (on an empty state) still runs.
            state[MASTER_KEY] = master
            optimizer.state[param] = state
            record = self._records[id(param)]
            record.local.copy_(record.working_tensor)  # the param is the cast of its master
            record.mark_synced()
        for param, old_grad in aliased:
            param.grad = old_grad

    def before_load(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        # torch casts floating state to each param's dtype on load; remember the saved values.
        # A master saved under the legacy key is loaded as MASTER_KEY.
        self._incoming_state = {k: canonical_state(v) for k, v in state_dict.get("state", {}).items()}
        self._incoming_groups = state_dict.get("param_groups", [])
        return {**state_dict, "state": self._incoming_state}

    @torch.no_grad()
    def after_load(self, optimizer: torch.optim.Optimizer) -> None:
        saved_state, saved_groups = self._incoming_state or {}, self._incoming_groups or []
        self._incoming_state = self._incoming_groups = None
        for group_index, (saved_group, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
            for position, (key, param) in enumerate(zip(saved_group["params"], group["params"])):
                self._records.pop(id(param), None)  # a loaded master, or a fresh upcast at the next step
                if not has_master(param.dtype, self.main_dtype) or key not in saved_state:
                    continue
                for name, value in saved_state[key].items():
                    if name != "step" and torch.is_tensor(value) and value.is_floating_point():
                        optimizer.state[param][name] = value.to(device=param.device, dtype=self.main_dtype, copy=True)
                if MASTER_KEY in optimizer.state[param]:
                    self._adopt_master(param, group_index, position)

    def _adopt_master(self, param: torch.Tensor, group_index: int, position: int) -> None:
        """The master in ``param``'s state becomes its record's master, and the param its cast."""
        state = self.optimizer.state[param]
        record = self._record(param, group_index, position)
        record.working = local_tensor(state[MASTER_KEY])
        state[MASTER_KEY] = record.wrap(record.working)
        record.local.copy_(record.working)  # the loaded master is the truth, the param its cast
        record.mark_synced()

    @torch.no_grad()
    def checkpoint_state(self, *, for_save: bool) -> dict[str, Any]:
        """The state dict a checkpoint saves, or (``for_save=False``) loads into in place.

        For a load, every param gets its fresh state (:func:`offload_fsdp.fresh_state.create_fresh_state`),
        in the main dtype where the param has a master (as its first step would create it, on
        the master), and each param that needs a master and has none gets one (its param
        widened), so saved fp32 values have fp32 tensors to land in.
        """
        optimizer = self.optimizer
        if not for_save:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            fresh = [p for p in params if not optimizer.state.get(p)]
            create_fresh_state(optimizer, fresh)
            for p in fresh:
                if has_master(p.dtype, self.main_dtype):
                    state = optimizer.state[p]
                    for name, value in state.items():
                        if name != "step" and torch.is_tensor(value) and value.is_floating_point():
                            state[name] = value.to(self.main_dtype)
            for group_index, group in enumerate(optimizer.param_groups):
                for position, p in enumerate(group["params"]):
                    if p.requires_grad and has_master(p.dtype, self.main_dtype):
                        state = optimizer.state[p]
                        if MASTER_KEY not in state:
                            state[MASTER_KEY] = self._master_of(self._record(p, group_index, position))
        return optimizer.state_dict()


def enable_main_params(optimizer: torch.optim.Optimizer, main_params_dtype: torch.dtype | None = torch.float32) -> None:
    """Make ``optimizer`` step main copies in ``main_params_dtype`` and read gradients via ``get_grad``.

    ``main_params_dtype=None``: no master copies (every param is stepped in its own
    dtype); gradients are still read through ``get_grad``.

    Side effects: registers step and load-state-dict hooks on ``optimizer``
    (idempotent); the optimizer state gains a ``"master_param"`` entry
    (:data:`offload_fsdp.master.MASTER_KEY`) for every parameter narrower than
    ``main_params_dtype``; ``optimizer.zero_grad`` is replaced, on this instance only,
    by one that also clears (or, with ``set_to_none=False``, zeroes in place) every
    param's ``decoupled_grad``, and ``optimizer.checkpoint_state`` is added (the method
    ``checkpoint.save`` / ``checkpoint.load`` use, as on ``HybridDeviceOptimizer``).
    """
    if getattr(optimizer, _HOOKS_ATTR, None) is not None:
        return
    hooks = _MainParamsHooks(optimizer, main_params_dtype)
    hooks.register()
    setattr(optimizer, _HOOKS_ATTR, hooks)
