"""Cost of the forward watcher: a training step's forward+backward with no watcher, with
``fastgrad.diagnose.collect.watch.ForwardWatcher`` (per-module hooks, and global hooks as ``python -m fastgrad.check`` uses)
and under ``torch.autograd.detect_anomaly()``.

    python benchmarks/bench_watch.py [--device cpu|cuda] [--reps 30] [--threads N] [--json out.json]

Every repetition times each configuration once (interleaved), so a noisy neighbour hurts all of them alike;
the table gives min and median per configuration and ratios against "none" of the same run (on a loaded
machine the min is the better estimate of the intrinsic cost).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastgrad.diagnose.collect.watch import ForwardWatcher  # noqa: E402


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


def _time(step, dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    dev = torch.device(ns.device)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    rows = []
    for wname, build in (("mlp 8x256, batch 64", mlp), ("transformer 2x128, 8x64 tokens", transformer)):
        model, loss_fn = build(dev)
        nmods = sum(1 for _ in model.modules())

        def step():
            model.zero_grad(set_to_none=True)
            loss_fn().backward()

        times = {c: [] for c in CONFIGS}
        # Interleaved: every repetition times each configuration once, so load changes hit all alike.
        for r in range(ns.reps + 2):
            for c in CONFIGS:
                with configured(c, model):
                    step()  # the first call after adding hooks is not timed
                    t = _time(step, dev)
                if r >= 2:  # warm-up repetitions
                    times[c].append(t)
        base_min, base_med = min(times["none"]), statistics.median(times["none"])
        for c in CONFIGS:
            mn, med = min(times[c]), statistics.median(times[c])
            rows.append({"workload": wname, "modules": nmods, "config": c, "min_ms": mn, "median_ms": med,
                         "min_vs_none": mn / base_min, "median_vs_none": med / base_med})
    print(f"# forward watcher cost, forward+backward, {dev} ({platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {ns.reps} interleaved reps)")
    print("| workload | modules | config | min ms | median ms | min vs none | median vs none |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['modules']} | {r['config']} | {r['min_ms']:.3f} | {r['median_ms']:.3f} | "
              f"{r['min_vs_none']:.2f}x | {r['median_vs_none']:.2f}x |")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"device": str(dev), "torch": torch.__version__, "rows": rows},
                                            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
