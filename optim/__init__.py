"""What sits between a training loop and an optimizer.

Precision policy, the ``decoupled_grad`` protocol, ``build_optimizer`` (torch /
Transformer Engine / apex backends, optional host offload), gradient clipping on
local shards, CUDA-graph-safe gradients and the memory model behind docs/optim.md.
"""

from offload_fsdp.grad import get_grad, local_tensor, set_grad, zero_grad
from offload_fsdp.graph_safe import GraphSafeGrads, graph_safe_grads
from offload_fsdp.precision import PrecisionPolicy
from optim.build import BACKENDS, build_optimizer
from optim.clip import clip_grad_norm_, grad_norm
from optim.main_params import enable_main_params

_LAZY = {"MemoryFootprint": "optim.memory", "bytes_per_param": "optim.memory"}


def __getattr__(name: str):
    # optim.memory is imported on first use only, so `python -m optim.memory` (which
    # prints the docs/optim.md table) runs it once, as __main__, without a double import.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'optim' has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "GraphSafeGrads",
    "MemoryFootprint",
    "PrecisionPolicy",
    "build_optimizer",
    "bytes_per_param",
    "clip_grad_norm_",
    "enable_main_params",
    "get_grad",
    "grad_norm",
    "graph_safe_grads",
    "local_tensor",
    "set_grad",
    "zero_grad",
]
