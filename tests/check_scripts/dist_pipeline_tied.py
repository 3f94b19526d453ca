"""A plain two-stage pipeline on gloo (2 ranks, written here from scratch): stage 0 holds the token embedding
and a first layer, stage 1 a second layer and the output layer whose weight is tied to the embedding (a copy
on the last stage, kept equal by all-reducing the two gradients, as Megatron-style pipelines do).

--norm stages: each stage sums its own gradients' squares, the sums all-reduced over the two stages: the tied
  embedding is counted on both stages, sqrt 2 too large on that part (NVIDIA/Megatron-LM PR #7228's class).
--norm copies: fastgrad.clip_grad_norm_ with process_group=Copies(WORLD, {tied weight: [0, 1]}): counted once.

Rank 0 writes the truth (FG_TRUTH): per step the norm the script clipped with and the float64 norm of the
whole model's gradients gathered onto rank 0 (the tied weight once)."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fastgrad
from fastgrad.distributed import Copies
from _truth import Truth

ap = argparse.ArgumentParser()
ap.add_argument("--norm", choices=["stages", "copies"], default="stages")
ap.add_argument("--max-norm", type=float, default=0.5)
ap.add_argument("--steps", type=int, default=5)
a = ap.parse_args()

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
assert dist.get_world_size() == 2, "two pipeline stages"
V, D, B, T = 20, 8, 4, 6
torch.manual_seed(0)
emb = torch.randn(V, D) * 0.5  # the tied weight, the same on both stages


class First(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.inner = nn.Linear(D, D)
        with torch.no_grad():
            self.embed.weight.copy_(emb)

    def forward(self, tok):
        return torch.tanh(self.inner(self.embed(tok)))


class Last(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.outer = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(emb)

    def forward(self, h):
        return self.head(torch.tanh(self.outer(h)))


stage = First() if rank == 0 else Last()
tied = stage.embed.weight if rank == 0 else stage.head.weight
opt = torch.optim.SGD(stage.parameters(), lr=0.5)
truth = Truth()
if rank:
    truth.path = None
gen = torch.Generator().manual_seed(7)  # both stages draw the same batch: the last one needs the targets
copies = Copies(dist.group.WORLD, {tied: [0, 1]})


def true_norm() -> float:
    mine = {n: p.grad.detach().clone() for n, p in stage.named_parameters()}
    got = [None] * 2 if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if rank:
        return float("nan")
    assert torch.equal(got[0]["embed.weight"], got[1]["head.weight"])  # one tensor held twice
    whole = [g for n, g in got[0].items()] + [g for n, g in got[1].items() if n != "head.weight"]
    return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in whole])))


for step in range(a.steps):
    tok = torch.randint(0, V, (B, T), generator=gen)
    target = torch.randint(0, V, (B, T), generator=gen)
    opt.zero_grad()
    if rank == 0:
        h = stage(tok)
        dist.send(h.detach(), 1)
        g = torch.empty_like(h)
        dist.recv(g, 1)
        h.backward(g)
        loss = torch.zeros(())
    else:
        h = torch.empty(B, T, D)
        dist.recv(h, 0)
        h.requires_grad_(True)
        loss = F.cross_entropy(stage(h).reshape(-1, V), target.reshape(-1))
        loss.backward()
        dist.send(h.grad, 0)
    dist.all_reduce(tied.grad)  # the tied weight's two gradients summed: the same on both stages
    t = true_norm()
    params = list(stage.parameters())
    if a.norm == "stages":
        sq = sum(p.grad.pow(2).sum() for p in params)
        dist.all_reduce(sq)
        total = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, a.max_norm, total)
    else:
        total = fastgrad.clip_grad_norm_(params, a.max_norm, process_group=copies)
    truth.add(step=step + 1, true=t, script=float(total), loss=float(loss))
    opt.step()
dist.barrier()  # every rank done before any tears gloo down (a rank left alone aborted at exit)
dist.destroy_process_group()
