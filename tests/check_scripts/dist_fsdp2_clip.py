"""FSDP2 done right (gloo, CPU, 2 ranks): fully_shard on each linear layer and the root, gradients as DTensors
sharded over the ranks, torch.nn.utils.clip_grad_norm_ reducing them (placements count each element once: no
alarm). Rank 0 writes the truth (FG_TRUTH): the float64 norm of the whole gradients, gathered with
full_tensor()."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from _truth import Truth

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
truth = Truth()
if rank:
    truth.path = None
gen = torch.Generator().manual_seed(10 + rank)
for step in range(5):
    x, y = torch.randn(8, 10, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    whole = [p.grad.full_tensor().double().reshape(-1) for p in model.parameters()]
    t = float(torch.linalg.vector_norm(torch.cat(whole)))
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    truth.add(step=step + 1, true=t, script=float(total.full_tensor()))
    opt.step()
dist.barrier()  # every rank done before any tears gloo down (a rank left alone aborted at exit)
dist.destroy_process_group()
