"""Host and CPU cost of ``StepGuard(model=...)``'s buffers' keeper on a ResNet-50-sized model (built from
torch.nn: the bottleneck layout [3, 4, 6, 3], 53 BatchNorm layers, 159 buffers, ~25.6M parameters).

Measured, interleaved round by round, microseconds of thread time (``time.thread_time``) per call:

* ``save``: the snapshot taken at the first forward after a decision (one flat copy per dtype);
* ``restore``: the decision's ``torch.where`` by the flag and the copy back;
* ``hooks``: a forward's disarmed pre-hooks (one per module that owns buffers), called as torch calls them;
* ``step``: for scale, one training step without the keeper (forward and backward of a batch of 2 images of
  64x64, ``guard.clip_()``, fused AdamW step).

    python benchmarks/guard_buffers_cpu.py --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        cout = mid * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def resnet50(classes=1000):
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, mid, stride if i == 0 else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def main(argv=None) -> int:
    import fastgrad
    from fastgrad.guard import BufferKeeper

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = resnet50()
    n_params = sum(p.numel() for p in model.parameters())
    n_bufs = len(list(model.buffers()))
    print(f"# fastgrad {fastgrad.__file__}, torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"{n_params / 1e6:.1f}M parameters, {n_bufs} buffers; microseconds of thread time per call; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    keeper = BufferKeeper(model)
    flag = torch.zeros((), dtype=torch.float32)
    hooks = [h for m in model.modules() for h in m._forward_pre_hooks.values()]
    keeper.save()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guard = fastgrad.StepGuard(opt, 1.0)
    x = torch.randn(2, 3, 64, 64)

    def step():
        model(x).square().mean().backward()
        guard.clip_()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def hooks_off():
        keeper._armed = False
        for h in hooks:
            h(None, ())

    variants = {"save": keeper.save, "restore": lambda: keeper.restore(flag), "hooks": hooks_off, "step": step}
    calls = {"save": 20, "restore": 20, "hooks": 200, "step": 1}
    keeper.remove()  # the step runs without the keeper; save/restore/hooks are called directly
    step()
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, fn in variants.items():
            t0 = time.thread_time()
            for _ in range(calls[k]):
                fn()
            times[k].append((time.thread_time() - t0) / calls[k] * 1e6)
    for k, ts in times.items():
        print(f"{k:8s} min {min(ts):10.1f}  median {statistics.median(ts):10.1f}")
    print(f"# load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
