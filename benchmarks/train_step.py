"""Training-step benchmark: what gradient clipping costs inside a real step, torch vs fastgrad.

One step = zero_grad(set_to_none=True) + forward + backward + gradient management + AdamW step, so every
step hands the clip a fresh generator of parameters and fresh ``.grad`` tensors, as a training loop does
(a micro-benchmark that reuses one list hides that host cost). Variants:

* ``none``: no clipping (the floor);
* ``torch`` / ``fastgrad``: ``clip_grad_norm_(model.parameters(), max_norm)``;
* ``torch_amp``: autocast + GradScaler: ``scaler.unscale_(opt)`` then torch's ``clip_grad_norm_``;
* ``fastgrad_amp``: autocast + GradScaler: ``fastgrad.scaler_unscale_and_clip(scaler, opt, max_norm)``;
* ``fastgrad_zw``: ``fastgrad.clip_optimizer_grad_norm_(opt, max_norm)`` (zero-write: with a fused AdamW the
  clip only reads the grads and the optimizer's step divides them by ``1 / coef``);
* ``fastgrad_amp_zw``: as ``fastgrad_amp`` with ``zero_write=True``.
* ``fastgrad_guard`` / ``fastgrad_amp_guard``: ``fastgrad.StepGuard(opt, max_norm, skip_factor=10)``,
  ``guard.clip_()`` (``guard.clip_(scaler)``) before the step: the guarded clip, whose bad-step flag reaches a
  fused AdamW as ``found_inf`` (compare with ``fastgrad_zw`` / ``fastgrad_amp_zw``, which hand over the
  coefficient the same way without a guard).

The zero-write variants move work into the optimizer step (the fused kernel divides every gradient and
stores the quotient back into ``.grad``), so compare their whole step, not only the clip region: ``opt_ms``
times the optimizer step region separately, and ``clipped_pct`` says in how many timed steps the clip
triggered (read after the step, outside the timed regions).

The optimizer is AdamW with ``fused=True`` where torch has a fused kernel for the device, else
``foreach=True`` (the CSV says which). Models: a GPT-2-small-shaped decoder (12 layers, d=768, 12 heads,
vocab 50,257, tied embedding; ``--size small`` shrinks it for CPU runs) and a ResNet-50-shaped CNN
(bottleneck blocks 3-4-6-3, built from torch.nn, no torchvision).

Reported per variant: step time (median, 10th and 90th percentile) and the gradient-management region
(the clip, or unscale + clip) timed separately: CUDA events for device time on GPU plus perf_counter for
the host time of the call; perf_counter on CPU. ``share`` is the median clip region over the median step.
Counted per step and per gradient-management region (``gm_``), in extra steps after the timed ones
(``fastgrad.benchmark.counting``; ``--no-counts`` skips them): torch operators dispatched (``step_ops``,
``gm_ops``), and on CUDA the kernels launched (``step_kernels``, ``gm_kernels``, torch.profiler) and host
syncs (``step_syncs``, ``gm_syncs``, ``torch.cuda.set_sync_debug_mode("warn")``).

    python benchmarks/train_step.py --device cuda --model gpt2,resnet50 --out train_step.csv
    python benchmarks/train_step.py --device cpu --model gpt2 --size small --steps 20
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import statistics
import sys
import time

import torch

if __name__ == "__main__":  # run as a script: measure this checkout's fastgrad, not another installed copy
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = ("none", "torch", "fastgrad", "torch_amp", "fastgrad_amp", "fastgrad_zw", "fastgrad_amp_zw",
            "fastgrad_guard", "fastgrad_amp_guard")


# ------------------------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2-small layout: token + position embeddings, pre-LN blocks, final LN, head tied to the token
    embedding (so 148 parameter tensors at 12 layers, as the H100 micro-benchmark's gpt2-124m)."""

    def __init__(self, layers=12, d=768, heads=12, vocab=50257, ctx=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.vocab = vocab

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.wte.weight)

    def loss(self, batch):
        idx, target = batch
        return F.cross_entropy(self(idx).flatten(0, 1).float(), target.flatten())


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.c1, self.b1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.c2, self.b2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.c3, self.b3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50 layout (stem, bottleneck stages 3-4-6-3, 161 parameter tensors); ``base`` scales the
    widths (64 is ResNet-50 itself)."""

    def __init__(self, base=64, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], base
        for i, n in enumerate((3, 4, 6, 3)):
            width = base * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)


def build(model: str, size: str, device: torch.device, args, seed: int = 0):
    """(model, batch) for one variant; the same seed gives every variant the same weights and data."""
    torch.manual_seed(seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    if model == "gpt2":
        if size == "full":
            m, vocab = GPT2(), 50257
        else:
            m, vocab = GPT2(layers=2, d=128, heads=4, vocab=2048, ctx=256), 2048
        batch, seq = args.batch or (8 if size == "full" else 4), args.seq or (512 if size == "full" else 64)
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        data = (idx[:, :-1].to(device), idx[:, 1:].to(device))
    elif model == "resnet50":
        m = ResNet50(base=64 if size == "full" else 8, classes=1000 if size == "full" else 100)
        batch, image = args.batch or (64 if size == "full" else 4), args.image or (224 if size == "full" else 32)
        x = torch.randn(batch, 3, image, image, generator=g)
        y = torch.randint(0, 1000 if size == "full" else 100, (batch,), generator=g)
        data = (x.to(device), y.to(device))
    else:
        raise SystemExit(f"unknown --model {model!r}: use gpt2 or resnet50")
    return m.to(device), data


def make_adamw(params, device: torch.device):
    try:
        return torch.optim.AdamW(params, lr=1e-4, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=1e-4, foreach=True), "foreach"


# ------------------------------------------------------------------------------------------- timing
class Clock:
    """Step and clip-region timing: CUDA events (device time) on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3


def _counter(kind: str | None):
    """A wrapper that runs a no-argument call and records what ``kind`` counts ("ops": torch operators;
    "cuda": kernels and host syncs), or just runs it (None)."""
    from fastgrad.benchmark import counting

    got = {}

    def run(fn):
        if kind == "ops":
            counts = counting.count_ops(fn)
            got["ops"] = sum(counts.values())
        elif kind == "cuda":
            got["kernels"], got["syncs"] = counting.count_cuda(fn)
        else:
            fn()

    return run, got


def run_variant(name: str, model_name: str, device: torch.device, args):
    import fastgrad

    model, batch = build(model_name, args.size, device, args)
    opt, opt_kind = make_adamw(model.parameters(), device)
    amp = "_amp" in name
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12) if amp else None
    clock = Clock(device)
    steps, clips, hosts, opts, totals = [], [], [], [], []
    backend = args.backend or None
    guard = fastgrad.StepGuard(opt, args.max_norm, skip_factor=10.0) if name.endswith("_guard") else None
    out = {}

    def manage():
        """The gradient-management region of the variant."""
        if name == "torch":
            out["total"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        elif name == "fastgrad":
            out["total"] = fastgrad.clip_grad_norm_(model.parameters(), args.max_norm, backend=backend)
        elif name == "torch_amp":
            scaler.unscale_(opt)
            out["total"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        elif name == "fastgrad_amp":
            out["total"] = fastgrad.scaler_unscale_and_clip(scaler, opt, args.max_norm, backend=backend)
        elif name == "fastgrad_zw":
            out["total"] = fastgrad.clip_optimizer_grad_norm_(opt, args.max_norm, backend=backend)
        elif name == "fastgrad_amp_zw":
            out["total"] = fastgrad.scaler_unscale_and_clip(scaler, opt, args.max_norm, backend=backend,
                                                            zero_write=True)
        elif guard is not None:
            out["total"] = guard.clip_(scaler)
        else:
            out["total"] = None

    def step(region=None):
        """One training step; ``region`` wraps the gradient-management call (a counter), untimed callers
        only. Returns the clock marks and the host time of the region."""
        s0 = clock.mark()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
            loss = model.loss(batch)
        (scaler.scale(loss) if amp else loss).backward()
        c0 = clock.mark()
        h0 = time.perf_counter()
        if region is None:
            manage()
        else:
            region(manage)
        h1 = time.perf_counter()
        c1 = clock.mark()
        if amp:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        s1 = clock.mark()
        out["loss"] = loss
        return s0, c0, c1, s1, (h1 - h0) * 1e3

    for i in range(args.warmup + args.steps):
        s0, c0, c1, s1, host = step()
        if clock.cuda:
            torch.cuda.synchronize()  # after the step: the timed region itself has no sync
        if i >= args.warmup:
            steps.append(clock.ms(s0, s1))
            clips.append(clock.ms(c0, c1))
            opts.append(clock.ms(c1, s1))
            hosts.append(host)
            totals.append(out["total"])
    last = float(out["loss"].detach())
    if not math.isfinite(last):
        print(f"warning: {model_name}/{name}: loss is {last}", file=sys.stderr)
    # after timing: how often the clip triggered (torch's rule: coef = max_norm / (norm + 1e-6) < 1)
    clipped = [float(t) + 1e-6 > args.max_norm for t in totals if t is not None]
    clipped_pct = 100.0 * sum(clipped) / len(clipped) if clipped else float("nan")
    counts = count_variant(step, device) if args.counts else {}
    return steps, clips, hosts, opts, clipped_pct, opt_kind, sum(1 for _ in model.parameters()), counts


def count_variant(step, device: torch.device) -> dict:
    """Counts per training step and per gradient-management region, from extra steps after the timed ones:
    torch operators (every device), and on CUDA kernels and host syncs. A whole step is counted with the
    counter around ``step()``, the region with the counter around the region alone, each in its own step."""
    from fastgrad.benchmark import counting

    got = {}
    got["step_ops"] = sum(counting.count_ops(step).values())
    region, seen = _counter("ops")
    step(region)
    got["gm_ops"] = seen["ops"]
    if device.type == "cuda":
        got["step_kernels"], got["step_syncs"] = counting.count_cuda(step)
        region, seen = _counter("cuda")
        step(region)
        got["gm_kernels"], got["gm_syncs"] = seen["kernels"], seen["syncs"]
        torch.cuda.synchronize()
    return got


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _counts_text(c: dict) -> str:
    """``  per step: kernels 412 (grad mgmt 3), syncs 0 (0), ops 980 (1)``; empty when nothing was counted."""
    parts = [f"{name} {c[f'step_{name}']} (grad mgmt {c[f'gm_{name}']})" for name in ("kernels", "syncs", "ops")
             if f"step_{name}" in c]
    return ("  per step: " + ", ".join(parts)) if parts else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="gpt2,resnet50", help="comma list of gpt2, resnet50")
    ap.add_argument("--size", default=None, choices=("full", "small"),
                    help="full: GPT-2 small / ResNet-50 (default on cuda); small: scaled down (default on cpu)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0, help="gpt2 sequence length")
    ap.add_argument("--image", type=int, default=0, help="resnet50 image side")
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--backend", default="", help="fastgrad backend= (default: automatic)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (CPU; 0: torch's default)")
    ap.add_argument("--out", default="train_step.csv", help="CSV file to write")
    ap.add_argument("--no-counts", dest="counts", action="store_false",
                    help="skip the counted steps after the timed ones (torch operators per step and per "
                         "gradient-management region; on CUDA also kernels and host syncs)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.size = args.size or ("full" if args.device == "cuda" else "small")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "fastgrad": __import__("fastgrad").__file__, "threads": torch.get_num_threads(),
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
    }
    fields = ["model", "size", "variant", "optimizer", "params", "steps", "step_ms_median", "step_ms_p10",
              "step_ms_p90", "clip_ms_median", "clip_host_ms_median", "clip_share_pct", "opt_ms_median", "clipped_pct",
              "step_ops", "gm_ops", "step_kernels", "gm_kernels", "step_syncs", "gm_syncs"]
    rows = []
    for model_name in [m for m in args.model.split(",") if m]:
        for v in variants:
            steps, clips, hosts, opts, clipped_pct, opt_kind, nparams, counts = run_variant(v, model_name, device,
                                                                                              args)
            med = statistics.median(steps)
            clip = statistics.median(clips) if v != "none" else 0.0
            row = {"model": model_name, "size": args.size, "variant": v, "optimizer": opt_kind,
                   "params": nparams, "steps": len(steps), "step_ms_median": f"{med:.3f}",
                   "step_ms_p10": f"{pct(steps, 0.1):.3f}", "step_ms_p90": f"{pct(steps, 0.9):.3f}",
                   "clip_ms_median": f"{clip:.3f}",
                   "clip_host_ms_median": f"{statistics.median(hosts) if v != 'none' else 0.0:.3f}",
                   "clip_share_pct": f"{100.0 * clip / med:.1f}",
                   "opt_ms_median": f"{statistics.median(opts):.3f}",
                   "clipped_pct": "" if v == "none" else f"{clipped_pct:.0f}"}
            row |= {k: counts.get(k, "") for k in fields if k.startswith(("step_", "gm_")) and not k.startswith(
                "step_ms")}
            rows.append(row)
            print(f"{model_name:9s} {v:13s} step {med:9.3f} ms [p10 {row['step_ms_p10']}, p90 "
                  f"{row['step_ms_p90']}]  grad mgmt {clip:8.3f} ms ({row['clip_share_pct']}%)  "
                  f"host {row['clip_host_ms_median']} ms  opt {row['opt_ms_median']} ms  clipped "
                  f"{row['clipped_pct'] or '-'}%  ({opt_kind} AdamW)" + _counts_text(counts), flush=True)
    with open(args.out, "w", newline="") as fh:
        for k, val in meta.items():
            fh.write(f"# {k}: {val}\n")
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
