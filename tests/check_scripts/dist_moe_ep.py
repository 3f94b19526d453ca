"""Expert parallelism on gloo (written here from scratch): a router and a shared expert that every rank keeps
whole (their gradients averaged over the ranks, as data parallelism does), and two experts per rank, each
rank holding other experts (expert e of rank r is global expert 2 r + e). Each rank routes its own batch; the
tokens an expert of another rank gets are sent there and back with all_to_all-style gathers.

--norm right: the experts' squares summed over the ranks, the router and the shared expert counted once.
--norm router-twice: the router taken for an expert (summed over the ranks): counted once per rank.
--norm shared-twice: the shared expert's two weights taken for experts: counted once per rank.
--norm experts-local: the experts' squares never summed over the ranks: the other ranks' experts missing.

Rank 0 writes the truth (FG_TRUTH): the float64 norm of every gradient gathered there, each expert once and
the replicated ones once."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _truth import Truth

ap = argparse.ArgumentParser()
ap.add_argument("--norm", choices=["right", "router-twice", "shared-twice", "experts-local"], default="right")
ap.add_argument("--max-norm", type=float, default=0.05)
ap.add_argument("--steps", type=int, default=3)
a = ap.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
D, H, E_LOCAL = 6, 8, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, H, bias=False)
        self.w2 = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(x)))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the replicated parts alike on every rank
        self.router = nn.Linear(D, E_LOCAL * world, bias=False)
        self.shared = Expert()
        torch.manual_seed(10 + rank)  # this rank's experts
        self.experts = nn.ModuleList(Expert() for _ in range(E_LOCAL))

    def forward(self, x):
        gate = F.softmax(self.router(x), -1)  # every token weighs every global expert (dense routing)
        out = self.shared(x)
        # every rank's tokens reach every rank's experts: gather the batches, run the local experts on all of
        # them, and reduce the weighted outputs back to their owners
        xs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(xs, x)
        allx = torch.cat(xs)
        local = torch.stack([e(allx) for e in self.experts], 1)  # [world * B, E_LOCAL, D]
        parts = list(local.split(x.shape[0]))
        got = _Exchange.apply(*parts)  # [world (owning expert rank), B, E_LOCAL, D] of this rank's tokens
        w = gate.reshape(x.shape[0], world, E_LOCAL).permute(1, 0, 2).unsqueeze(-1)
        return out + (got * w).sum((0, 2))


class _Exchange(torch.autograd.Function):
    """parts[r]: this rank's experts on rank r's tokens -> for this rank's tokens, every rank's experts' outputs."""

    @staticmethod
    def forward(ctx, *parts):
        mine = []
        for src in range(world):
            buf = parts[src].clone() if src == rank else torch.empty_like(parts[0])
            for dst in range(world):
                if src == dst:
                    continue
                if rank == src:
                    dist.send(parts[dst].contiguous(), dst)
                elif rank == dst:
                    dist.recv(buf, src)
            mine.append(buf)
        return torch.stack(mine)

    @staticmethod
    def backward(ctx, g):  # g[j]: rank j's experts on this rank's tokens; rank j gets it back for its parts[me]
        back = [g[rank].clone() if j == rank else torch.empty_like(g[0]) for j in range(world)]
        for src in range(world):
            for dst in range(world):
                if src == dst:
                    continue
                if rank == src:
                    dist.send(g[dst].contiguous(), dst)
                elif rank == dst:
                    dist.recv(back[src], src)
        return tuple(back)


model = MoE()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
truth = Truth()
if rank:
    truth.path = None
gen = torch.Generator().manual_seed(100 + rank)
REPLICATED = [n for n, _ in model.named_parameters() if not n.startswith("experts.")]
names = {id(p): n for n, p in model.named_parameters()}


def true_norm() -> float:
    mine = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    got = [None] * world if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank:
        return float("nan")
    for r in range(1, world):  # the replicated gradients are the same bytes on every rank
        assert all(torch.equal(got[0][n], got[r][n]) for n in REPLICATED)
    whole = [got[0][n] for n in REPLICATED] + [g[n] for g in got for n in g if n.startswith("experts.")]
    return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in whole])))


as_expert = {"router-twice": ["router.weight"], "shared-twice": ["shared.w1.weight", "shared.w2.weight"]}
for step in range(a.steps):
    x = torch.randn(5, D, generator=gen)
    y = torch.randn(5, D, generator=gen)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for n in REPLICATED:  # data parallelism for the replicated parts
        p = dict(model.named_parameters())[n]
        dist.all_reduce(p.grad)
        p.grad /= world
    t = true_norm()
    params = list(model.parameters())
    summed = torch.zeros((), dtype=torch.float32)
    once = torch.zeros((), dtype=torch.float32)
    for p in params:
        n = names[id(p)]
        expert = n.startswith("experts.") or n in as_expert.get(a.norm, [])
        if expert:
            summed = summed + p.grad.pow(2).sum()
        else:
            once = once + p.grad.pow(2).sum()
    if a.norm != "experts-local":
        dist.all_reduce(summed)
    total = (summed + once).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, a.max_norm, total)
    truth.add(step=step + 1, true=t, script=float(total), loss=float(loss))
    opt.step()
dist.barrier()  # every rank done before any tears gloo down (a rank left alone aborted at exit)
dist.destroy_process_group()
