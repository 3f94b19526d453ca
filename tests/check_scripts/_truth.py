"""Ground truth for the check tests, computed by the scripts themselves without fastgrad: per-step gradient
norms (float64, all gradients of the step's parameters) and losses, written as JSON to $FG_TRUTH at exit."""
import atexit
import json
import math
import os

import torch


def grad_norm(params) -> float:
    gs = [p.grad.detach().to(torch.float64).reshape(-1) for p in params if p.grad is not None]
    gs = [g.to_dense() if g.is_sparse else g for g in gs]
    return float(torch.linalg.vector_norm(torch.cat(gs))) if gs else 0.0


def flat_params(params) -> torch.Tensor:
    """Every parameter as one float64 vector: take it before and after ``step()`` for :func:`update_ratio`."""
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def update_ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    """The whole model's update size relative to its weights, ||after - before|| / ||before||."""
    return float((after - before).norm() / before.norm())


class Truth:
    def __init__(self):
        self.steps = []
        self.meta = {}
        self.path = os.environ.get("FG_TRUTH")  # read once: an in-process run's variable is gone at exit
        atexit.register(self.write)

    def add(self, **row):
        self.steps.append({k: (float(v) if isinstance(v, (int, float, torch.Tensor)) else v) for k, v in row.items()})
        self.write()

    def write(self):
        path = self.path
        if path:
            clean = lambda v: v if not isinstance(v, float) or math.isfinite(v) else str(v)  # noqa: E731
            with open(path, "w") as f:
                json.dump({"steps": [{k: clean(v) for k, v in r.items()} for r in self.steps], **self.meta}, f)
