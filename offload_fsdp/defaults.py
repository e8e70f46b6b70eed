"""Hyper-parameters of a device share whose class differs from the host class.

The wrapper's param groups are completed with ``cpu_optimizer_cls``'s defaults
(that is what ``param_groups`` and ``defaults`` show, and what LR schedulers
edit). When ``gpu_optimizer_cls`` is another class, those filled-in values are
not what the user chose: AdamW's ``weight_decay=0.01`` handed to SGD would
silently decay the device share. The rule, the same as passing the user's
keyword arguments to both classes (the Megatron-LM convention):

* a value the user set (a constructor keyword, a key in one of their group
  dicts, or for a wrapped optimizer a value other than its class's default)
  applies to both shares;
* a value left at the host class's default gives the device share the device
  class's own default, until the wrapper group's value changes (a scheduler,
  a user edit, a loaded state dict): from then on it applies to both shares.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Any

import torch

_NOT_HYPER = ("params", "param_names")


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters: every key but ``params`` and ``param_names``."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


__all__ = ["DeviceDefaults", "class_defaults", "hyperparameters", "same_value", "snapshot_value"]


def class_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The keyword defaults of ``cls``'s constructor (the nearest ``__init__`` in its MRO that names them).

    A subclass whose ``__init__`` only forwards ``*args, **kwargs`` inherits its
    base's defaults. Returns ``{}`` when no signature can be read.
    """
    for klass in cls.__mro__:
        if klass is torch.optim.Optimizer or klass is object:
            break
        if "__init__" not in vars(klass):
            continue
        try:
            parameters = inspect.signature(vars(klass)["__init__"]).parameters.values()
        except (TypeError, ValueError):
            return {}
        named = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
        if named or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return named
    return {}


def same_value(a: Any, b: Any) -> bool:
    """Equality of hyper-parameter values that never raises (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd user value is simply "not the same"
        return False


def snapshot_value(value: Any) -> Any:
    """``value`` as it is now, to compare against later with :func:`same_value`."""
    # A tensor lr is updated in place by schedulers: keep a copy to compare against.
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class DeviceDefaults:
    """Per wrapper group, the hyper-parameters still at the host class's default; maps groups for the device class.

    Only keys the device class has a default for are tracked; any other key
    (e.g. AdamW's ``betas`` for SGD) is passed through, and a class ignores keys
    it does not read.
    """

    def __init__(self, gpu_cls: type[torch.optim.Optimizer]) -> None:
        self.gpu_defaults = class_defaults(gpu_cls)
        self._left: dict[int, dict[str, Any]] = {}
        """wrapper group index -> {key: the host-class default it was filled with}"""

    def add_group(self, index: int, group: dict[str, Any], explicit: Collection[str]) -> None:
        """Record which of ``group``'s values (wrapper group ``index``) the user did not set.

        ``explicit``: the keys the user set. Replaces any earlier record for ``index``.
        """
        self._left[index] = {
            k: snapshot_value(v)
            for k, v in hyperparameters(group).items()
            if k not in explicit and k in self.gpu_defaults
        }

    def for_device(self, index: int, group: dict[str, Any]) -> dict[str, Any]:
        """The hyper-parameters of wrapper group ``index`` as the device class should see them.

        Side effect: a key whose value has changed since construction is the
        user's from now on (it stays shared even if changed back).
        """
        left = self._left.get(index, {})
        out = hyperparameters(group)
        for key in list(left):
            if key in out and same_value(out[key], left[key]):
                out[key] = self.gpu_defaults[key]
            else:
                del left[key]
        return out
