"""StepGuard: (a) a small Transformer trained on the CPU with injected NaN batches and 100x gradient spikes,
unguarded vs guarded vs a clean run; (b) the guard's cost against the unguarded clip.

    python -m benchmarks.bench_guard                    # both parts, results under benchmarks/results/guard-cpu/
    python -m benchmarks.bench_guard --part train --steps 400
    python -m benchmarks.bench_guard --part cost --reps 400
    python -m benchmarks.bench_guard --part modes --reps 300   # guard.clip_ per mode vs clip_grad_norm_

(a) Runs (same seed, same data order, AdamW lr 3e-3, clip max_norm 1.0):
  clean            no faults, fastgrad.clip_grad_norm_(params, 1.0)
  unguarded        faults injected, fastgrad.clip_grad_norm_(params, 1.0)
  unguarded-spikes only the spikes injected (the NaN batches would end the unguarded run first)
  unclipped-spikes only the spikes injected, no clip at all (what a spike does to AdamW by itself)
  guarded          faults injected, StepGuard(opt, 1.0, skip_factor=10)  (skips NaN and > 10x max_norm)
  guarded-zclip    faults injected, StepGuard(opt, mode="zclip", skip_factor=10)
A NaN batch puts a NaN into one embedding output (every gradient that depends on it goes NaN); a spike batch
multiplies the loss by 100. Writes train.csv (step, run, loss) and train.png.

(b) clip cost: ``guard.clip_()`` vs the unguarded clip it replaces, timed in interleaved rounds (A B A B ...),
median and best of all repetitions, gradients restored (untimed) before each. Fused AdamW: vs
``clip_optimizer_grad_norm_`` (both hand the coefficient to the optimizer); foreach AdamW: vs
``clip_grad_norm_`` (both write). Also clip+step for each, and for fused AdamW the guarded clip+step against
``clip_grad_norm_`` (which writes) + step as well. Writes cost.csv.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import time

import torch
import torch.nn as nn

import fastgrad

OUT = os.path.join(os.path.dirname(__file__), "results", "guard-cpu")
VOCAB, SEQ, BATCH = 64, 32, 16


class TinyLM(nn.Module):
    def __init__(self, d=64, heads=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens, poison=False):
        x = self.emb(tokens) + self.pos
        if poison:
            x = x.clone()
            x[0, 0, 0] = float("nan")
        return self.head(self.enc(x, mask=self.mask, is_causal=True))


def _markov_data(steps, seed=0):
    """Token sequences from a fixed random sparse Markov chain: learnable, with a known entropy floor."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 3.0
    probs = torch.softmax(logits, -1)
    out = []
    for _ in range(steps):
        t = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        t[:, 0] = torch.randint(VOCAB, (BATCH,), generator=g)
        for i in range(SEQ):
            t[:, i + 1] = torch.multinomial(probs[t[:, i]], 1, generator=g).squeeze(1)
        out.append(t)
    return out


def _faults(steps):
    nan = {s for s in (90, 91, 230) if s < steps}
    spike = {s for s in (50, 140, 180, 300, 330) if s < steps}
    return nan, spike


def train(run, data, steps):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=True)
    nan, spike = _faults(steps)
    if run == "clean":
        nan, spike = set(), set()
    elif run in ("unguarded-spikes", "unclipped-spikes"):
        nan = set()
    guard = None
    if run == "guarded":
        guard = fastgrad.StepGuard(opt, 1.0, skip_factor=10.0)
    elif run == "guarded-zclip":
        guard = fastgrad.StepGuard(opt, mode="zclip", skip_factor=10.0)
    params = list(model.parameters())
    losses = []
    for step in range(steps):
        batch = data[step]
        logits = model(batch[:, :-1], poison=step in nan)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        (loss * (100.0 if step in spike else 1.0)).backward()
        if run == "unclipped-spikes":
            pass
        elif guard is None:
            fastgrad.clip_grad_norm_(params, 1.0)
        else:
            guard.clip_()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    info = guard.state() if guard is not None else {}
    return losses, info


def part_train(steps):
    data = _markov_data(steps)
    runs = ["clean", "unguarded", "unguarded-spikes", "unclipped-spikes", "guarded", "guarded-zclip"]
    curves, infos = {}, {}
    for r in runs:
        t0 = time.perf_counter()
        curves[r], infos[r] = train(r, data, steps)
        print(f"{r:17s} final loss {curves[r][-1]:.4f}  ({time.perf_counter() - t0:.1f} s) {infos[r]}")
    with open(os.path.join(OUT, "train.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + runs)
        for s in range(steps):
            w.writerow([s] + [f"{curves[r][s]:.6f}" for r in runs])
    # summary: mean loss over the last 50 steps, per run
    tail = {r: statistics.fmean(v for v in curves[r][-50:]) for r in runs}
    with open(os.path.join(OUT, "train_summary.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "mean_loss_last50", "skipped_steps", "nonfinite_steps", "spike_steps"])
        for r in runs:
            i = infos[r]
            w.writerow([r, f"{tail[r]:.6f}", i.get("skipped_steps", ""), i.get("nonfinite_steps", ""),
                        i.get("spike_steps", "")])
    plot(curves, steps)
    return tail


def plot(curves, steps):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    nan, spike = _faults(steps)
    fig, ax = plt.subplots(figsize=(9, 5))
    for r, ys in curves.items():
        line, = ax.plot(range(steps), ys, label=r, lw=1.2, ls="--" if r.startswith("guarded") else "-")
        # a NaN loss is not drawn: mark where a run died (NaN from there to the end; a poisoned batch alone
        # has a NaN loss for its own step in every run)
        alive = [s for s, v in enumerate(ys) if math.isfinite(v)]
        dead = alive[-1] + 1 if alive and alive[-1] + 1 < len(ys) else None
        if dead is not None:
            ax.plot([dead], [max(v for v in ys if math.isfinite(v))], "x", ms=10, color=line.get_color())
            ax.annotate(f"{r}: loss NaN from step {dead} on", (dead, ys[dead - 1]), xytext=(dead + 10, 3.6),
                        color=line.get_color(), arrowprops=dict(arrowstyle="->", color=line.get_color()))
    for s in nan:
        ax.axvline(s, color="red", alpha=0.3, lw=0.8)
    for s in spike:
        ax.axvline(s, color="orange", alpha=0.3, lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step (red: NaN batch, orange: 100x spike)")
    ax.set_ylabel("training loss")
    ax.set_title("TinyLM on CPU, AdamW: injected NaN batches and 100x gradient spikes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "train.png"), dpi=110)


def replot():
    with open(os.path.join(OUT, "train.csv")) as f:
        rows = list(csv.DictReader(f))
    runs = [k for k in rows[0] if k != "step"]
    plot({r: [float(row[r]) for row in rows] for r in runs}, len(rows))


def _timed(fn, restore):
    restore()
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def part_cost(reps):
    torch.manual_seed(0)
    rows = []
    for size, dims in (("tiny", dict(d=64, layers=2)), ("medium", dict(d=256, layers=6))):
        rows += _cost_rows(reps if size == "tiny" else max(reps // 5, 20), size, dims)
    with open(os.path.join(OUT, "cost.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def _one_batch_grads(dims):
    """A TinyLM's parameters with the gradients of one batch, and a function that puts those gradients back
    (every timed repetition starts from the same gradients)."""
    model = TinyLM(**dims)
    params = list(model.parameters())
    batch = _markov_data(1)[0]
    loss = nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    saved = [p.grad.clone() for p in params]

    def restore():
        for p, g in zip(params, saved):
            p.grad.copy_(g)
    return params, restore


def _cost_rows(reps, size, dims):
    rows = []
    for fused in (True, False):
        params, restore = _one_batch_grads(dims)

        kw = dict(fused=True) if fused else dict(foreach=True)
        opt_a = torch.optim.AdamW(params, lr=1e-5, **kw)
        opt_b = torch.optim.AdamW(params, lr=1e-5, **kw)
        guard = fastgrad.StepGuard(opt_b, 1.0)
        if fused:
            unguarded = lambda: fastgrad.clip_optimizer_grad_norm_(opt_a, 1.0)  # noqa: E731
        else:
            unguarded = lambda: fastgrad.clip_grad_norm_(params, 1.0)  # noqa: E731
        guarded = guard.clip_

        def step_a():
            unguarded()
            opt_a.step()

        def step_b():
            guarded()
            opt_b.step()

        # fused only: also against the plain writing clip (fastgrad.clip_grad_norm_, then the fused step),
        # the step most users have before they add a guard; for foreach that is step_a already
        opt_c = torch.optim.AdamW(params, lr=1e-5, **kw) if fused else None

        def step_c():
            fastgrad.clip_grad_norm_(params, 1.0)
            opt_c.step()

        warm = (unguarded, guarded, step_a, step_b) + ((step_c,) if fused else ())
        for f in warm:  # warm-up (state creation, first-call costs)
            for _ in range(5):
                _timed(f, restore)
        times = {"clip": ([], []), "clip+step": ([], [])}
        if fused:
            times["clip+step vs clip_grad_norm_+step"] = ([], times["clip+step"][1])  # the same guarded times
        for _ in range(reps):
            times["clip"][0].append(_timed(unguarded, restore))
            times["clip"][1].append(_timed(guarded, restore))
            times["clip+step"][0].append(_timed(step_a, restore))
            times["clip+step"][1].append(_timed(step_b, restore))
            if fused:
                times["clip+step vs clip_grad_norm_+step"][0].append(_timed(step_c, restore))
        for what, (a, b) in times.items():
            ma, mb = statistics.median(a), statistics.median(b)
            rows.append(dict(model=size, optimizer="AdamW fused" if fused else "AdamW foreach", what=what,
                             tensors=len(params), elements=sum(p.numel() for p in params),
                             unguarded_median_us=round(ma, 1),
                             guarded_median_us=round(mb, 1), ratio_median=round(mb / ma, 3),
                             unguarded_best_us=round(min(a), 1), guarded_best_us=round(min(b), 1),
                             ratio_best=round(min(b) / min(a), 3)))
            print(rows[-1])
    return rows


def part_modes(reps):
    """guard.clip_() per mode against the unguarded clip_grad_norm_ (foreach AdamW, so every mode writes),
    interleaved, gradients restored before each repetition. Writes modes.csv."""
    rows = []
    for size, dims in (("tiny", dict(d=64, layers=2)), ("medium", dict(d=256, layers=6))):
        torch.manual_seed(0)
        params, restore = _one_batch_grads(dims)

        fns = {"clip_grad_norm_": lambda: fastgrad.clip_grad_norm_(params, 1.0)}
        for mode in ("norm", "zclip", "autoclip", "adagc"):
            opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
            kw = dict(max_norm=1.0) if mode in ("norm", "adagc") else {}
            fns[mode] = fastgrad.StepGuard(opt, mode=mode, **kw).clip_
        for f in fns.values():
            for _ in range(30):  # past the warm-ups (25 zclip steps)
                _timed(f, restore)
        n = reps if size == "tiny" else max(reps // 5, 20)
        times = {k: [] for k in fns}
        for _ in range(n):
            for k, f in fns.items():
                times[k].append(_timed(f, restore))
        base_med, base_best = statistics.median(times["clip_grad_norm_"]), min(times["clip_grad_norm_"])
        for k, t in times.items():
            rows.append(dict(model=size, tensors=len(params), elements=sum(p.numel() for p in params), op=k,
                             median_us=round(statistics.median(t), 1), best_us=round(min(t), 1),
                             ratio_median=round(statistics.median(t) / base_med, 3),
                             ratio_best=round(min(t) / base_best, 3)))
            print(rows[-1])
    with open(os.path.join(OUT, "modes.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["train", "cost", "both", "plot", "modes"], default="both",
                    help="plot: redraw train.png from train.csv")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(OUT, exist_ok=True)
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} torch {torch.__version__} "
          f"{platform.processor() or platform.machine()} threads={args.threads} load={load}")
    if args.part == "plot":
        return replot()
    if args.part == "modes":
        part_modes(args.reps)
        print(f"load after: {os.getloadavg()}")
        return
    if args.part in ("train", "both"):
        part_train(args.steps)
    if args.part in ("cost", "both"):
        part_cost(args.reps)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
