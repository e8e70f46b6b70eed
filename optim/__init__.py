"""What sits between a training loop and an optimizer: precision policy and gradient access."""

from optim.grad import get_grad, local_tensor, set_grad
from optim.precision import PrecisionPolicy

__all__ = ["PrecisionPolicy", "get_grad", "local_tensor", "set_grad"]
