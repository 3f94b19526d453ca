"""ZeRO over data parallelism of a tensor-parallel model, on gloo with 4 ranks (tp=2 x dp=2, rank = 2 dp + tp;
written here from scratch). Each tp rank's local model (a LayerNorm and a row-parallel bias kept whole on both
tp ranks, a column-parallel weight and bias and a row-parallel weight split) is flattened; its gradient is
averaged over dp and cut in two partitions, partition d kept by the rank of dp coordinate d, which clips and
steps its flat fp32 partition and hands the new weights back (all-gather over dp).

--norm deepspeed: the partitions' squares, the replicated tensors' elements counted on tp rank 0 only,
  all-reduced over the world (the right norm), no layout declared.
--norm declared: fastgrad.clip_grad_norm_(partition, process_group=WORLD) with the partition's layout
  declared (fastgrad.distributed.Partition: which slices belong to which parameter, replicated over tp or not).
--norm declared-sum: the layout declared, but the script's own norm counts every slice on every rank: the
  replicated slices twice.

Rank 0 writes the truth (FG_TRUTH): the float64 norm of the whole model's gradients rebuilt on rank 0."""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastgrad
from fastgrad.distributed import Partition
from _truth import Truth

ap = argparse.ArgumentParser()
ap.add_argument("--norm", choices=["deepspeed", "declared", "declared-sum"], default="deepspeed")
ap.add_argument("--max-norm", type=float, default=0.05)
ap.add_argument("--steps", type=int, default=3)
a = ap.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, "tp=2 x dp=2"
TP = 2
dp_rank, tp_rank = divmod(rank, TP)
tp_groups = [dist.new_group([2 * d, 2 * d + 1]) for d in range(2)]
dp_groups = [dist.new_group([t, t + 2]) for t in range(2)]
tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
tp_ranks = [2 * dp_rank, 2 * dp_rank + 1]

D, H, O = 6, 8, 4
torch.manual_seed(0)
full = {"ln.weight": 1 + 0.1 * torch.randn(D), "ln.bias": 0.1 * torch.randn(D),
        "fc1.weight": torch.randn(H, D) / D ** 0.5, "fc1.bias": 0.1 * torch.randn(H),
        "fc2.weight": torch.randn(O, H) / H ** 0.5, "fc2.bias": 0.1 * torch.randn(O)}
SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
REPLICATED = {"ln.weight", "ln.bias", "fc2.bias"}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, H // TP)
        self.fc2 = torch.nn.Linear(H // TP, O)
        with torch.no_grad():
            for n, p in self.named_parameters():
                p.copy_(full[n].chunk(TP, SPLIT[n])[tp_rank] if n in SPLIT else full[n])

    def forward(self, x):
        h = torch.tanh(self.fc1(_Copy.apply(self.ln(x))))
        y = F.linear(h, self.fc2.weight)
        y = _Sum.apply(y)
        return y + self.fc2.bias


class _Copy(torch.autograd.Function):  # identity; the input's gradient summed over tp (the LayerNorm's whole)
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=tp_group)
        return g


class _Sum(torch.autograd.Function):  # the row-parallel partial outputs summed over tp; gradient as it is
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=tp_group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


model = Model()
named = list(model.named_parameters())
sizes = [p.numel() for _, p in named]
offsets = [sum(sizes[:i]) for i in range(len(sizes))]
total_len = sum(sizes)
cut = total_len // 2
lo, hi = (0, cut) if dp_rank == 0 else (cut, total_len)
partition = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for _, p in named])[lo:hi].clone())
opt = torch.optim.SGD([partition], lr=0.1)
slices = []  # (offset in the partition, length, owner, replicated over)
replicated_mask = torch.zeros(hi - lo, dtype=torch.bool)
for (n, p), off, size in zip(named, offsets, sizes):
    a0, b0 = max(off, lo), min(off + size, hi)
    if a0 < b0:
        slices.append((a0 - lo, b0 - a0, p, tp_ranks if n in REPLICATED else None))
        replicated_mask[a0 - lo:b0 - lo] = n in REPLICATED
if a.norm != "deepspeed":
    Partition(partition, slices)
truth = Truth()
if rank:
    truth.path = None
gen = torch.Generator().manual_seed(100 + dp_rank)


def true_norm() -> float:
    mine = {n: p.grad.detach().clone() for n, p in named}
    got = [None] * world if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank:
        return float("nan")
    assert all(torch.equal(got[0][n], got[1][n]) for n in REPLICATED)  # replicated: the same on both tp ranks
    whole = {n: (torch.cat([got[t][n] for t in range(TP)], SPLIT[n]) if n in SPLIT else got[0][n]) for n in full}
    return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in whole.values()])))


for step in range(a.steps):
    x = torch.randn(8, D, generator=gen)
    y = torch.randn(8, O, generator=gen)
    loss = F.mse_loss(model(x), y)
    model.zero_grad()
    loss.backward()
    for _, p in named:  # data parallelism: the gradients averaged over dp
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= 2
    t = true_norm()
    partition.grad = torch.cat([p.grad.reshape(-1) for _, p in named])[lo:hi].clone()
    g = partition.grad
    if a.norm == "declared":
        total = fastgrad.clip_grad_norm_([partition], a.max_norm, process_group=dist.group.WORLD)
    else:
        keep = ~replicated_mask if (a.norm == "deepspeed" and tp_rank != 0) else torch.ones_like(replicated_mask)
        sq = g[keep].pow(2).sum()
        dist.all_reduce(sq)
        total = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_([partition], a.max_norm, total)
    truth.add(step=step + 1, true=t, script=float(total), loss=float(loss))
    opt.step()
    with torch.no_grad():  # the new weights back into the model (each dp rank's half, gathered over dp)
        halves = [None, None]
        dist.all_gather_object(halves, partition.detach().clone(), group=dp_group)
        flat = torch.cat(halves)
        for (_, p), off, size in zip(named, offsets, sizes):
            p.copy_(flat[off:off + size].view_as(p))
dist.barrier()  # every rank done before any tears gloo down (a rank left alone aborted at exit)
dist.destroy_process_group()
