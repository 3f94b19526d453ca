"""Cost of the forward watcher: a training step's forward+backward with no watcher, with
``fastgrad.watch.ForwardWatcher`` (per-module hooks, and global hooks as ``python -m fastgrad.check`` uses)
and under ``torch.autograd.detect_anomaly()``.

    python benchmarks/bench_watch.py [--device cpu|cuda] [--rounds 3] [--json out.json]

The configurations are measured in interleaved rounds and each keeps its best median, so a noisy neighbour
hurts all of them alike; ratios are against "none" of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import Timer  # noqa: E402
from fastgrad.watch import ForwardWatcher  # noqa: E402


def mlp(device):
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).to(device)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    return model, lambda: torch.nn.functional.cross_entropy(model(x), y)


def transformer(device):
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 128), torch.nn.TransformerEncoder(layer, 2),
                                torch.nn.Linear(128, 1000)).to(device)
    tok = torch.randint(0, 1000, (8, 64), device=device)
    return model, lambda: torch.nn.functional.cross_entropy(model(tok).flatten(0, 1), tok.flatten())


@contextlib.contextmanager
def configured(name, model):
    if name == "none":
        yield
    elif name == "watcher":
        with ForwardWatcher(model):
            yield
    elif name == "watcher (global)":
        with ForwardWatcher():
            yield
    elif name == "detect_anomaly":
        with torch.autograd.detect_anomaly(check_nan=True):
            yield
    else:
        raise ValueError(name)


CONFIGS = ["none", "watcher", "watcher (global)", "detect_anomaly"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    dev = torch.device(ns.device)
    torch.manual_seed(0)
    timer = Timer(dev, warmup=3, min_reps=5, max_reps=40, budget_s=0.5, flush_l2=False)
    rows = []
    for wname, build in (("mlp 8x256, batch 64", mlp), ("transformer 2x128, 8x64 tokens", transformer)):
        model, loss_fn = build(dev)
        nmods = sum(1 for _ in model.modules())
        best = {c: float("inf") for c in CONFIGS}
        for _ in range(ns.rounds):
            for c in CONFIGS:
                with configured(c, model):
                    def step():
                        model.zero_grad(set_to_none=True)
                        loss_fn().backward()
                    best[c] = min(best[c], timer.measure(step).median_ms)
        for c in CONFIGS:
            rows.append({"workload": wname, "modules": nmods, "config": c, "median_ms": best[c],
                         "vs_none": best[c] / best["none"]})
    print(f"# forward watcher cost, forward+backward, {dev} ({platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print("| workload | modules | config | median ms | vs none |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['modules']} | {r['config']} | {r['median_ms']:.3f} | {r['vs_none']:.2f}x |")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"device": str(dev), "torch": torch.__version__, "rows": rows},
                                            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
