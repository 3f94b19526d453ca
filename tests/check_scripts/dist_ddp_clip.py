"""Data parallelism done right (gloo, 2 ranks): DistributedDataParallel averages the gradients, so every rank
holds the same gradients whole, and torch.nn.utils.clip_grad_norm_ on the local parameters is the true norm
(the replicas are one tensor held in copies: counted once, no alarm). Rank 0 writes the truth (FG_TRUTH):
the float64 norm of its gradients, and a check that the other rank's are the same bytes."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _truth import Truth, grad_norm

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
truth = Truth()
if rank:
    truth.path = None
gen = torch.Generator().manual_seed(10 + rank)
for step in range(5):
    x, y = torch.randn(8, 10, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, grads)
    assert all(torch.equal(a, b) for other in got for a, b in zip(grads, other))  # replicas, byte for byte
    t = grad_norm(model.parameters())
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    truth.add(step=step + 1, true=t, script=float(total))
    opt.step()
dist.barrier()  # every rank done before any tears gloo down (a rank left alone aborted at exit)
dist.destroy_process_group()
