"""A vocab-parallel embedding: ``RowwiseParallel`` on ``nn.Embedding`` (its rows split over the ranks, each
rank's partial lookup summed by torch's own output hook), through ``parallelize_module`` on a gloo
DeviceMesh, then a replicated head. The embedding's output is a DTensor with a ``Partial`` placement until
torch's hook redistributes it: a watcher that reduces it first changes what the model computes.

Rank 0 writes the truth (FG_TRUTH), recorded with plain hooks: per step the loss and the float64 norm of
the whole model's gradients (each DTensor gathered whole, counted once) and the update's size relative to
the weights."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from _truth import Truth

dist.init_process_group("gloo")
torch.set_num_threads(1)
world = dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
V, D = 64, 16
model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, V))
parallelize_module(model, mesh, {"0": RowwiseParallel(input_layouts=Replicate())})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
truth = Truth() if dist.get_rank() == 0 else None


def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def flat_weights():
    return torch.cat([whole(p.detach()).reshape(-1).double() for p in model.parameters()])


def whole_norm() -> float:
    sq = 0.0
    for p in model.parameters():
        g = whole(p.grad)
        sq += float(g.double().pow(2).sum())
    return sq ** 0.5


for step in range(1, 9):
    g = torch.Generator().manual_seed(step)  # the same batch on every rank
    tok = torch.randint(0, V, (8, 12), generator=g)
    opt.zero_grad()
    logits = model(tok[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, V), tok[:, 1:].reshape(-1))
    loss.backward()
    n, before = whole_norm(), flat_weights()
    opt.step()
    after = flat_weights()
    if truth is not None:
        truth.add(step=step, loss=loss.item(), norm=n, update=float((after - before).norm() / before.norm()))
dist.barrier()  # every rank done before any tears gloo down (a rank left alone aborted at exit)
dist.destroy_process_group()
