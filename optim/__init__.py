"""What sits between a training loop and an optimizer.

Precision policy, the ``decoupled_grad`` protocol, ``build_optimizer`` (torch /
Transformer Engine / apex backends, optional host offload), gradient clipping on
local shards, CUDA-graph-safe gradients and the memory model behind docs/optim.md.
"""

from optim.build import BACKENDS, build_optimizer
from optim.clip import clip_grad_norm_, grad_norm
from optim.graph_safe import GraphSafeGrads, graph_safe_grads
from optim.grad import get_grad, local_tensor, set_grad, zero_grad
from optim.main_params import enable_main_params
from optim.memory import MemoryFootprint, bytes_per_param
from optim.precision import PrecisionPolicy

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
