"""Let a stock ``torch.optim`` optimizer honour main params and decoupled gradients.

``torch.optim`` reads ``param.grad`` and updates ``param`` in its own dtype. A
bf16 parameter whose fp32 gradient lives in ``param.decoupled_grad`` (see
:mod:`offload_fsdp.grad`) therefore cannot be stepped as is: ``.grad`` is empty, and
an update applied in bf16 would drop everything below bf16's resolution.

:func:`enable_main_params` fixes that with the optimizer's own hooks, keeping
the optimizer a real ``torch.optim`` object of its own class whose ``param_groups``
hold the model's parameters (so LR schedulers and ``get_state_dict`` work):

* before ``step``, every parameter with a gradient is pointed (``param.data``)
  at its master copy in ``main_params_dtype`` (:mod:`offload_fsdp.master`: which
  params get one, in what dtype), kept in the optimizer state under
  ``"master_param"`` (state saved under the old key ``"main_param"`` loads as it),
  and its ``.grad`` at the gradient from :func:`~offload_fsdp.grad.get_grad`
  (cast to the main dtype only if it is not already in it). A param written since
  the last step (a weight load, an in-place edit: its version counter moved) is
  adopted into its master first, as ``HybridDeviceOptimizer`` does;
* after ``step``, the updated main copy is cast back into the parameter's own
  storage, and ``.grad`` is restored to what it was;
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
from offload_fsdp.grad import get_grad, zero_decoupled_grad
from offload_fsdp.master import MASTER_KEY, adopt_written, canonical_state, has_master

__all__ = ["enable_main_params"]

_HOOKS_ATTR = "_optim_main_params_hooks"


def _version_key(param: torch.Tensor) -> tuple[int, int]:
    # An in-place write (load, copy_, mul_) bumps the version counter; a new storage moves data_ptr.
    return (param.data_ptr(), param._version)


class _MainParamsHooks:
    """The step / load hooks of one optimizer, and what must be undone after the current step."""

    def __init__(self, optimizer: torch.optim.Optimizer, main_dtype: torch.dtype | None) -> None:
        self.optimizer = optimizer
        self.main_dtype = main_dtype
        # id(param) -> its version key when it and its master last agreed (absent: compare before the next
        # step). Keyed by id: the optimizer's param_groups hold every param, so an id is never reused.
        self._synced: dict[int, tuple[int, int]] = {}
        # (param, its own storage or None when only .grad was aliased, the .grad to restore)
        self._undo: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
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

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        assert not self._undo, "step hooks re-entered: a previous step did not finish"
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = get_grad(param)
                if grad is None:
                    continue
                if not has_master(param.dtype, self.main_dtype):
                    # The param is its own main copy (fp32, or wider); only .grad may need aliasing.
                    if grad is not param.grad:  # e.g. an fp32 decoupled grad of an fp32 param
                        self._undo.append((param, None, param.grad))
                        param.grad = grad.to(param.dtype)
                    continue
                self._swap_in_main(optimizer, param, grad)

    def _swap_in_main(self, optimizer: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor) -> None:
        assert self.main_dtype is not None  # has_master said this param has one
        state = optimizer.state[param]
        main = state.get(MASTER_KEY)
        if main is None:
            # First step: the main copy starts as the exact upcast of the param.
            main = param.detach().to(self.main_dtype, copy=True)
        elif self._synced.get(id(param)) != _version_key(param):
            adopt_written(main, param.detach())  # the user's weights are the truth
        own_storage, old_grad = param.data, param.grad
        param.grad = None  # set .grad only after .data has the main dtype (torch checks dtypes)
        param.data = main
        param.grad = grad if grad.dtype == self.main_dtype else grad.to(self.main_dtype)
        self._undo.append((param, own_storage, old_grad))

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        undo, self._undo = self._undo, []
        for param, own_storage, old_grad in undo:
            param.grad = None
            if own_storage is not None:
                main = param.data
                own_storage.copy_(main)
                param.data = own_storage
                # Stored after the step so torch's lazy state init (on an empty state) still runs.
                optimizer.state[param][MASTER_KEY] = main
                self._synced[id(param)] = _version_key(param)
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
        for saved_group, group in zip(saved_groups, optimizer.param_groups):
            for key, param in zip(saved_group["params"], group["params"]):
                self._synced.pop(id(param), None)
                if not has_master(param.dtype, self.main_dtype) or key not in saved_state:
                    continue
                for name, value in saved_state[key].items():
                    if name != "step" and torch.is_tensor(value) and value.is_floating_point():
                        optimizer.state[param][name] = value.to(device=param.device, dtype=self.main_dtype, copy=True)
                master = optimizer.state[param].get(MASTER_KEY)
                if master is not None:
                    param.copy_(master)  # the loaded master is the truth, the param its cast
                    self._synced[id(param)] = _version_key(param)

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
            for p in params:
                if p.requires_grad and has_master(p.dtype, self.main_dtype) and MASTER_KEY not in optimizer.state[p]:
                    assert self.main_dtype is not None  # has_master said so
                    optimizer.state[p][MASTER_KEY] = p.detach().to(self.main_dtype, copy=True)
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
