"""What ``python -m fastgrad.check`` notes about the script's loss calls and the tensors it backpropagates:

- whether a cross-entropy, which applies its own log-softmax, was handed probabilities (each row in [0, 1] and
  summing to 1) instead of logits: a device flag per call, summed on the device and read once at the end;
- which node made the tensor passed to ``backward()`` (host only: ``grad_fn``'s class name), so that a window
  of several backward calls per optimizer step can be told from a loss divided over it.

Nothing here reads a device value."""

from __future__ import annotations

import re

from torch import Tensor

__all__ = ["LOSS_NODE", "loss_node", "probability_rows", "softmax_made"]

#: the autograd nodes a loss function's output carries (NllLossBackward0 for F.cross_entropy, MseLossBackward0,
#: BinaryCrossEntropyWithLogitsBackward0, SmoothL1LossBackward0, ...): a tensor whose grad_fn is one of these
#: was neither divided nor multiplied after the loss function returned it
LOSS_NODE = re.compile(r"(Loss|Entropy)\w*Backward\d*$")


def loss_node(t) -> str | None:
    """The class name of ``t``'s ``grad_fn`` when it is a loss function's node (``LOSS_NODE``), else None."""
    fn = getattr(t, "grad_fn", None)
    name = type(fn).__name__ if fn is not None else ""
    return name if LOSS_NODE.search(name) else None


def probability_rows(x: Tensor, tol: float) -> Tensor | None:
    """A device bool: every value of ``x`` (a cross-entropy's input, classes on dim 1, or dim 0 unbatched) lies
    in [0, 1] and each row sums to 1 within ``tol``. None where it is not a plain floating-point tensor of
    rows (a DTensor is left alone: reducing it here would run collectives torch's own code does not)."""
    if type(x) is not Tensor or not x.is_floating_point() or x.dim() == 0 or x.numel() == 0:
        return None
    v = x.detach()
    dim = 1 if v.dim() >= 2 else 0
    if v.shape[dim] < 2:
        return None
    inside = (v.amin() >= 0) & (v.amax() <= 1)
    return inside & ((v.float().sum(dim) - 1).abs().amax() <= tol)


def softmax_made(x) -> bool:
    """Host: ``x`` is a softmax's output (nn.Softmax, F.softmax, torch.softmax), read off its ``grad_fn``."""
    fn = getattr(x, "grad_fn", None)
    return fn is not None and type(fn).__name__.startswith("SoftmaxBackward")

