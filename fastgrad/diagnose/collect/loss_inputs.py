"""What ``python -m fastgrad.check`` notes about the script's loss calls and the tensors it backpropagates:

- whether a cross-entropy, which applies its own log-softmax, was handed probabilities (each row in [0, 1] and
  summing to 1) instead of logits: a device flag per call, summed on the device and read once at the end;
- which node made the tensor passed to ``backward()`` (host only: ``grad_fn``'s class name), so that a window
  of several backward calls per optimizer step can be told from a loss divided over it;
- with which sign the loss functions under that tensor enter it (``criterion_sign``: host only, the graph's
  nodes and the constants it scaled by), so that a loss negated before ``backward()`` can be told.

Nothing here reads a device value."""

from __future__ import annotations

import re

from torch import Tensor

__all__ = ["LOSS_NODE", "criterion_sign", "loss_node", "probability_rows", "softmax_made"]

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



#: nodes a scalar loss passes through with its sign unchanged (a reduction, a reshape, an AMP cast)
_SIGN_KEPT = re.compile(r"^(Mean|Sum|Squeeze|Unsqueeze|View|Reshape\w*|Clone|ToCopy|Expand|Alias)Backward\d*$")


def _constant_sign(fn) -> int | None:
    """The sign of the constant a Mul/Div node scaled by (a Python number or a CPU scalar: a host read, never a
    device one), or None where the other operand is not such a constant."""
    if not any(n is None for n, _ in fn.next_functions):
        return None      # both operands carry gradient: not a scaling by a constant
    c = getattr(fn, "_saved_other", None)
    if c is None:
        c = getattr(fn, "_saved_self", None)
    if isinstance(c, (int, float)):
        v = float(c)
    elif isinstance(c, Tensor) and c.dim() == 0 and c.device.type == "cpu":
        v = float(c)
    else:
        return None
    return (v > 0) - (v < 0)


def criterion_sign(t, limit: int = 32) -> tuple[int, int, str | None]:
    """See :func:`_criterion_sign`; never raises (it runs inside the script's ``backward()`` and
    ``GradScaler.scale``: a graph it cannot read, such as one whose saved tensors were freed, is unknown)."""
    try:
        return _criterion_sign(t, limit)
    except Exception:  # noqa: BLE001 - watching never changes what the script computes
        return 0, 0, None


def _criterion_sign(t, limit: int) -> tuple[int, int, str | None]:
    """Host: ``(negated, kept, node)``: how many loss-function nodes (``LOSS_NODE``) the scalar ``t`` reaches
    with its sign flipped (a ``-loss``, ``loss * -1``, the second operand of a subtraction) and with it kept,
    following only the nodes whose effect on the sign is known without a device read (negation, scaling by a
    constant, sums and differences, reductions, casts); ``node``: the first negated one's class name (none
    negated: the first kept one's). Looks at
    no more than ``limit`` nodes: a loss function sits a few nodes under the tensor passed to ``backward()``."""
    neg = kept = 0
    first = kept_first = None
    todo = [(getattr(t, "grad_fn", None), 1)]
    seen = 0
    while todo and seen < limit:
        fn, sign = todo.pop()
        if fn is None or sign == 0:
            continue
        seen += 1
        name = type(fn).__name__
        nxt = [n for n, _ in fn.next_functions]
        if LOSS_NODE.search(name):
            if sign < 0:
                neg += 1
                first = first or name
            else:
                kept += 1
                kept_first = kept_first or name
            continue
        if name.startswith("NegBackward"):
            todo.append((nxt[0], -sign))
        elif _SIGN_KEPT.match(name):
            todo.append((nxt[0], sign))
        elif name in ("AddBackward0", "SubBackward0"):
            alpha = getattr(fn, "_saved_alpha", 1)
            s2 = ((alpha > 0) - (alpha < 0)) * (-1 if name.startswith("Sub") else 1) \
                if isinstance(alpha, (int, float)) else 0
            todo.extend([(nxt[0], sign), (nxt[1], sign * s2)])
        elif name in ("AddBackward1", "SubBackward1"):   # a tensor plus or minus a number
            todo.append((nxt[0], sign))
        elif name == "RsubBackward1":                    # a number minus the tensor
            todo.append((nxt[0], -sign))
        elif name.startswith(("MulBackward", "DivBackward")):
            c = _constant_sign(fn)
            if c:
                todo.extend((n, sign * c) for n in nxt if n is not None)
    return neg, kept, first or kept_first
