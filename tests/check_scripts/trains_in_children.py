"""Training only in child processes (the A3C pattern: workers step a shared model); the parent steps nothing."""
import torch
import torch.multiprocessing as mp


def train(model, rank):
    torch.manual_seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    model = torch.nn.Linear(4, 1)
    model.share_memory()
    procs = [mp.Process(target=train, args=(model, r)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
