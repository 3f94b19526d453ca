"""DDP started by torch.multiprocessing.spawn (the tutorials' pattern): the parent only spawns; each rank trains.
With LOSSES=path, rank 0 writes its losses there (the plain run's record, to compare the checked run with)."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def main(rank, world, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(25):
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0 and os.environ.get("LOSSES"):
            with open(os.environ["LOSSES"], "w") as f:
                json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1]), nprocs=2)
