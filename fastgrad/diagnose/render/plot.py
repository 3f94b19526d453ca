"""PNG plots of a gradient-norm history: a monitor's (``GradientMonitor.plot``) and a checked run's
(``python -m fastgrad.check --out``). matplotlib's object API (no pyplot: no global backend switch, no window).
One visual cue per meaning: the healthy band is green, the 100/1000 thresholds dotted horizontal lines,
non-finite steps purple vertical lines, steps whose norm overflowed float32 purple triangles at the top."""

from __future__ import annotations

import math
import textwrap

from ..rules.trends import detect_trends
from ..thresholds import Thresholds

__all__ = ["plot_monitor", "plot_run"]


def _figure(size):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # optional dependency
        raise ImportError("the plot needs matplotlib: pip install matplotlib") from e
    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig


def plot_monitor(h: dict, th: Thresholds, trend_args: dict, path, title: str) -> str:
    """A monitor's history ``h`` (``GradientMonitor.history()``): the total norm (log scale), its spikes,
    the non-finite steps and the healthy band."""
    fig = _figure((8, 4))
    ax = fig.add_subplot()
    pts = [(s, v) for s, v in zip(h["steps"], h["total_norm"]) if math.isfinite(v) and v > 0]
    if pts:
        ax.plot([s for s, _ in pts], [v for _, v in pts], lw=1.2, label="total grad norm")
        spikes = detect_trends(h["steps"], h["total_norm"], thresholds=th, **trend_args)
        marks = {s for f in spikes if f.code == "spike" for s in f.steps}
        sp = [(s, v) for s, v in pts if s in marks]
        if sp:
            ax.scatter([s for s, _ in sp], [v for _, v in sp], color="tab:red", zorder=3, label="spike")
        ax.set_yscale("log")
    bad = [s for s, v in zip(h["steps"], h["nonfinite"]) if v > 0]
    for i, s in enumerate(bad):
        ax.axvline(s, color="tab:purple", alpha=0.4, lw=0.8, label="non-finite step" if i == 0 else None)
    ax.axhspan(th.healthy_low, th.healthy_high, color="tab:green", alpha=0.1, label="healthy range")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    ax.set_title(title)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return str(path)


def plot_run(res, path: str) -> str:
    """A checked run (``CheckResult``): the gradient norm per step and optimizer (before clipping where the
    clip's return is the norm of unscaled gradients, else the norm the update used, and the label says
    which), the thresholds, non-finite and overflowed steps, and the loss on a second axis."""
    fig = _figure((8, 4.5))
    ax = fig.add_subplot()
    th = Thresholds()
    ax.axhspan(th.healthy_low, th.healthy_high, color="green", alpha=0.08, label="healthy range")
    ax.axhline(th.exploding, color="orange", lw=0.8, ls=":", label="warning (100)")
    ax.axhline(th.critical, color="red", lw=0.8, ls=":", label="critical (1000)")
    names = res.series or ["steps"]
    before = all(r.clip_norm is not None for r in res.steps if r.clipped) and any(r.clipped for r in res.steps)
    for k, name in enumerate(names):
        rows = [r for r in res.steps if r.series == k]
        pts = [(r.step, r.grad_norm) for r in rows if math.isfinite(r.grad_norm) and r.grad_norm > 0]
        if pts:
            ax.plot(*zip(*pts), lw=1.2, label=f"grad norm ({name})" if len(names) > 1 else "grad norm")
    bad = sorted({r.step for r in res.steps if r.bad}
                 | {r.step for r in res.steps if r.loss is not None and not math.isfinite(r.loss)})
    for i, s in enumerate(bad):
        ax.axvline(s, color="tab:purple", alpha=0.4, label="non-finite step" if i == 0 else None)
    over = [r.step for r in res.steps if r.overflow]
    if over:
        ax.plot(over, [th.critical * 10] * len(over), "^", color="tab:purple", ms=5,
                label="norm overflowed float32 (inf)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm (before clipping)" if before or not any(r.clipped for r in res.steps)
                  else "gradient norm (after clipping: the clip's return was not readable)")
    losses = [(r.step, r.loss) for r in res.steps if r.loss is not None and math.isfinite(r.loss)]
    handles, labels = ax.get_legend_handles_labels()
    if losses:
        ax2 = ax.twinx()
        (line,) = ax2.plot(*zip(*losses), color="gray", lw=0.8, alpha=0.7)
        handles.append(line)
        labels.append("loss (right axis)")
        ax2.set_ylabel("loss (gray)")
        if min(v for _, v in losses) > 0 and max(v for _, v in losses) > 100 * min(v for _, v in losses):
            ax2.set_yscale("log")
    # below the axes, never over the curves (inside, it covered the loss at the start of the run)
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    # the whole command: runs of one script differ by their arguments
    cmd = " ".join([res.script] + list(res.args))
    ax.set_title("\n".join(textwrap.wrap(cmd, 90) + textwrap.wrap(f"{res.status.upper()}; trend: {res.trend}", 90)),
                 fontsize=9)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
