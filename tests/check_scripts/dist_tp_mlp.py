"""Hand-written tensor parallelism (Megatron style, written here from scratch) on gloo: a LayerNorm, a
column-parallel linear layer (weight and bias split by rows) and a row-parallel one (weight split by columns,
its bias replicated), on tp=2 ranks, times dp = WORLD_SIZE / 2 data-parallel replicas averaged by hand.

--norm tp-sum: the norm is every local gradient's square summed, all-reduced over the tensor-parallel group:
  the LayerNorm and the row-parallel bias, whole on both tp ranks, are counted twice (the bug class of
  ROCm/TransformerEngine PR #715 and NVIDIA-NeMo/RL PR #3788).
--norm local: torch.nn.utils.clip_grad_norm_ on this rank's parameters: the other tp rank's shards are missing.
--norm right: the replicated tensors counted on tp rank 0 only (the correct hand-written norm).
--norm bias-twice: as right, but the filter knows only the LayerNorm as replicated: the row-parallel bias is
  counted on both tp ranks (a partial over-count: one tensor twice, every other one right).
--norm ln-twice: as right, but the filter knows only the row-parallel bias as replicated: the LayerNorm's
  weight and bias are counted on both tp ranks (with --sp, Megatron's sequence-parallel LayerNorm taken for a
  tensor-parallel one).
--sp: sequence parallelism: each tp rank applies the LayerNorm to its half of the tokens, the halves are
  gathered before the column-parallel layer, and the LayerNorm's gradients (each rank's from its own tokens)
  are all-reduced over tp before the norm.
--norm shard-missed: as right, but fc1.weight is taken for a replicated tensor (its "model parallel" mark
  lost): only tp rank 0's shard of it is counted (a partial under-count).

Rank 0 writes the truth (FG_TRUTH): per step the norm the script clipped with and the float64 norm of the
whole model's gradients, gathered onto rank 0 and rebuilt from the shards."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _truth import Truth

ap = argparse.ArgumentParser()
ap.add_argument("--norm", choices=["tp-sum", "local", "right", "bias-twice", "ln-twice", "shard-missed"],
                default="tp-sum")
ap.add_argument("--sp", action="store_true")
ap.add_argument("--max-norm", type=float, default=0.05)
ap.add_argument("--steps", type=int, default=5)
a = ap.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
TP = 2
DP = world // TP
dp_rank, tp_rank = divmod(rank, TP)
tp_groups = [dist.new_group(list(range(d * TP, d * TP + TP))) for d in range(DP)]  # every rank makes every group
dp_groups = [dist.new_group(list(range(t, world, TP))) for t in range(TP)]
tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]


class CopyToTP(torch.autograd.Function):  # identity forward; the input's gradient summed over the tp ranks
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=tp_group)
        return g


class GatherFromSP(torch.autograd.Function):  # the tp ranks' token halves gathered; gradient: the sum's half
    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(TP)]
        dist.all_gather(parts, x.contiguous(), group=tp_group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=tp_group)
        return g.chunk(TP)[tp_rank]


class ReduceFromTP(torch.autograd.Function):  # partial outputs summed over the tp ranks; gradient as it is
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=tp_group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


D, H, O = 8, 12, 4
torch.manual_seed(0)  # the whole model, the same on every rank; each keeps its part
full = {"ln.weight": 1 + 0.1 * torch.randn(D), "ln.bias": 0.1 * torch.randn(D),
        "fc1.weight": torch.randn(H, D) / D ** 0.5, "fc1.bias": 0.1 * torch.randn(H),
        "fc2.weight": torch.randn(O, H) / H ** 0.5, "fc2.bias": 0.1 * torch.randn(O)}
SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # the sharded tensors and their split dimension
REPLICATED = ["ln.weight", "ln.bias", "fc2.bias"]


class Part(nn.Module):
    def __init__(self, w, b=None):
        super().__init__()
        self.weight = nn.Parameter(w.clone())
        self.bias = None if b is None else nn.Parameter(b.clone())


class TPMLP(nn.Module):
    def __init__(self):
        super().__init__()
        mine = {k: (v.chunk(TP, SPLIT[k])[tp_rank] if k in SPLIT else v) for k, v in full.items()}
        self.ln = nn.LayerNorm(D)
        with torch.no_grad():
            self.ln.weight.copy_(mine["ln.weight"])
            self.ln.bias.copy_(mine["ln.bias"])
        self.fc1 = Part(mine["fc1.weight"], mine["fc1.bias"])
        self.fc2 = Part(mine["fc2.weight"], mine["fc2.bias"])

    def forward(self, x):
        if a.sp:  # this rank's half of the tokens through the LayerNorm, then every token
            h = GatherFromSP.apply(self.ln(x.chunk(TP)[tp_rank]))
        else:
            h = CopyToTP.apply(self.ln(x))
        h = torch.tanh(F.linear(h, self.fc1.weight, self.fc1.bias))
        return ReduceFromTP.apply(F.linear(h, self.fc2.weight)) + self.fc2.bias


model = TPMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
truth = Truth()
if rank:
    truth.path = None
gen = torch.Generator().manual_seed(100 + dp_rank)  # a batch per data-parallel replica, the same on its tp ranks


def true_norm() -> float:
    """The whole model's gradients on rank 0, rebuilt from every rank's (float64), each element once."""
    mine = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    got = [None] * world if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank:
        return float("nan")
    assert all(torch.equal(got[0][n], got[1][n]) for n in REPLICATED)  # one tensor on both tp ranks
    whole = {n: (torch.cat([got[t][n] for t in range(TP)], SPLIT[n]) if n in SPLIT else got[0][n])
             for n in full}
    return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in whole.values()])))


for step in range(a.steps):
    x = torch.randn(16, D, generator=gen)
    y = torch.randn(16, O, generator=gen)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if a.sp:  # the LayerNorm's gradients, each from this rank's tokens: summed over tp
        for p in model.ln.parameters():
            dist.all_reduce(p.grad, group=tp_group)
    if DP > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= DP
    t = true_norm()
    params = list(model.parameters())
    if a.norm == "local":
        total = torch.nn.utils.clip_grad_norm_(params, a.max_norm)
    else:
        names = dict((id(p), n) for n, p in model.named_parameters())
        once = {"right": REPLICATED, "bias-twice": ["ln.weight", "ln.bias"], "ln-twice": ["fc2.bias"],
                "shard-missed": REPLICATED + ["fc1.weight"]}.get(a.norm, [])  # counted on tp rank 0 only
        sq = torch.zeros((), dtype=torch.float32)
        for p in params:
            if names[id(p)] in once and tp_rank != 0:
                continue
            sq = sq + p.grad.pow(2).sum()
        dist.all_reduce(sq, group=tp_group)
        total = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, a.max_norm, total)
    truth.add(step=step + 1, true=t, script=float(total), loss=float(loss))
    opt.step()
dist.barrier()  # every rank done before any tears gloo down (a rank left alone aborted at exit)
dist.destroy_process_group()
