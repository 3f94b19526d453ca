"""Renderings of one step's report (``GradientReport``): Markdown, plain text fitted to a width, rich tables.
Presentation only: the findings and the advice are decided before."""

from __future__ import annotations

import io
import math
import shutil
import textwrap

from ..advice import advise
from ..finding import fmt as _fmt, layers_text as _layers_text

__all__ = ["summary_rows", "to_markdown", "to_text", "show", "abbrev"]

LAYER_HEAD = ["Layer", "Grad norm", "Max abs", "Param norm", "Grad/param", "Zero", "NaN", "Inf"]


def recommendations(rep) -> list[tuple[str, str, str]]:
    return advise(rep.findings, run=False)


def summary_rows(rep) -> list[tuple[str, str]]:
    rows = [("Status", rep.status.upper()), ("Total gradient norm", _fmt(rep.total_norm))]
    if rep.param_norm is not None:
        rows += [("Parameter norm", _fmt(rep.param_norm)), ("Grad / param norm ratio", _fmt(rep.ratio))]
    frac = rep.zero / rep.numel if rep.numel else 0.0
    rows += [
        ("Max abs gradient", _fmt(rep.max_abs)),
        ("NaN / Inf values", f"{rep.nan:,} / {rep.inf:,}"),
        ("Zero-gradient parameters", f"{len(rep.zero_params())} of {len(rep.params)} tensors entirely zero"),
        ("Zero gradient values", f"{frac:.1%} of {rep.numel:,} values"),
        ("Tensors with a gradient", f"{len(rep.params)} (without: {len(rep.no_grad)})"),
    ]
    for r in rep.row_sparse:
        rows.append((f"Row-sparse {r.name}", f"{r.touched:,} of {r.rows:,} rows touched, norm/row "
                     f"{_fmt(r.per_row)}" + ("; left out of the depth rule" if r.excluded else "")))
    if rep.pre_clip_norm is not None or rep.clip_max_norm is not None:
        rows.append(("Clip", f"norm {_fmt(rep.pre_clip_norm)} before, max_norm {_fmt(rep.clip_max_norm)}"))
    if rep.skipped_steps is not None:
        rows.append(("Skipped steps", f"{rep.skipped_steps:,} since the previous report"))
    if rep.loss is not None:
        rows.append(("Loss", _fmt(rep.loss) + ("" if math.isfinite(rep.loss) else " (NON-FINITE)")))
    if rep.loss_progress is not None:
        rows.append(("Loss history", "improving" if rep.loss_progress else "not improving"))
    if rep.step is not None:
        rows.insert(0, ("Step", str(rep.step)))
    return rows


def layer_rows(rep, max_layers: int) -> tuple[list[list[str]], int]:
    rows = []
    for r in rep.layers[:max_layers]:
        zero = f"{r.zero / r.numel:.1%}" if r.numel else "-"
        rows.append([r.name, _fmt(r.norm), _fmt(r.max_abs), _fmt(r.param_norm), _fmt(r.ratio), zero,
                     str(r.nan), str(r.inf)])
    return rows, max(0, len(rep.layers) - max_layers)


def fitted_layer_table(rep, max_layers: int, width: int | None, per_col: int, fixed: int
                        ) -> tuple[list[str], list[list[str]], int, list[str]]:
    """(head, rows, more, left-out column names) of the per-layer table fitted to ``width`` columns: a
    table cell costs ``per_col`` characters besides its text and the table ``fixed`` more. Columns are
    left out, in this order, until the layer names get a reasonable width: NaN and Inf when every value
    is 0 (the summary has the totals), then Max abs, then Param norm; then the names are abbreviated
    from the middle (:func:`_abbrev`), so the distinguishing end (``1.self_attn.out_proj``) stays."""
    rows, more = layer_rows(rep, max_layers)
    head = list(LAYER_HEAD)
    if width is None or not rows:
        return head, rows, more, []
    cols = list(range(len(head)))

    def need(c):
        return max([len(head[c])] + [len(r[c]) for r in rows]) + per_col

    longest = max(len(r[0]) for r in rows)
    want = min(longest, 32)
    dropped = []
    order = [c for c in (6, 7) if all(r[c] == "0" for r in rows)] + [2, 3]
    for c in order:
        if width - fixed - sum(need(k) for k in cols if k) - per_col >= want:
            break
        cols.remove(c)
        dropped.append(head[c])
    budget = max(8, width - fixed - sum(need(k) for k in cols if k) - per_col)
    out = [[abbrev(r[0], budget)] + [r[c] for c in cols if c] for r in rows]
    return [head[c] for c in cols], out, more, dropped


def to_markdown(rep, max_layers: int = 50) -> str:
    """Markdown: Summary table, Issues Detected (severity, affected layers), Recommendations (with code),
    then per-layer gradients (at most ``max_layers`` rows)."""
    out = ["# Gradient report" + (f" (step {rep.step})" if rep.step is not None else ""), "",
           "## Summary", "", "| Metric | Value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in summary_rows(rep)]
    out += ["", "## Issues Detected", ""]
    if not rep.findings:
        out.append("No issues detected: the gradients look healthy.")
    else:
        out += ["| Severity | Issue | Affected layers | Detail |", "|---|---|---|---|"]
        for f in rep.findings:
            out.append(f"| {f.severity} | {_md(f.title)} | {_md(_layers_text(f))} | {_md(f.detail)} |")
    out += ["", "## Recommendations", ""]
    recs = recommendations(rep)
    if not recs:
        out.append("None: keep training.")
    for code, text, snippet in recs:
        out += [f"### {code}", "", text, ""]
        if snippet:
            out += ["```python", snippet, "```", ""]
    rows, more = layer_rows(rep, max_layers)
    if rows:
        out += ["", "## Per-layer gradients", "", "| " + " | ".join(LAYER_HEAD) + " |",
                "|" + "---|" * len(LAYER_HEAD)]
        out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
        if more:
            out.append(f"\n({more} more layers not shown)")
    return "\n".join(out).rstrip() + "\n"


def to_text(rep, max_layers: int = 30, width: int | None = None) -> str:
    """Plain-text rendering (what :meth:`show` prints when rich is not installed). ``width``: fit the
    lines into that many columns (prose wrapped; the per-layer table loses its all-zero NaN/Inf columns,
    then Max abs and Param norm, and abbreviates layer names from the middle); None: no limit."""
    buf = io.StringIO()

    def say(text: str, indent: str = "", first: str | None = None) -> None:
        first = indent if first is None else first
        if width is None:
            print(first + text, file=buf)
        else:
            print(textwrap.fill(text, width, initial_indent=first, subsequent_indent=indent,
                                break_on_hyphens=False), file=buf)
    title = "Gradient report" + (f" (step {rep.step})" if rep.step is not None else "")
    print(title, "=" * len(title), sep="\n", file=buf)
    w = max(len(k) for k, _ in summary_rows(rep))
    for k, v in summary_rows(rep):
        print(f"{k:<{w}}  {v}", file=buf)
    print("\nIssues detected:" if rep.findings else "\nNo issues detected.", file=buf)
    for f in rep.findings:
        say(f"[{f.severity.upper()}] {f.title}", "      ", "  ")
        if f.layers or f.steps:
            say(f"affected: {_layers_text(f)}", "      ")
        if f.detail:
            say(f.detail, "      ")
    for code, text, snippet in recommendations(rep):
        print("", file=buf)
        say(f"Recommendation ({code}): {text}", "  ", "")
        for line in snippet.splitlines():
            print(f"    {line}", file=buf)
    head, rows, more, dropped = fitted_layer_table(rep, max_layers, width, 2, -2)
    if rows:
        table = [head] + rows
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        print("", file=buf)
        for row in table:
            print("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                            for i, c in enumerate(row)).rstrip(), file=buf)
        if more:
            print(f"({more} more layers not shown)", file=buf)
        if dropped:
            say(f"(left out to fit {width} columns: {', '.join(dropped)}; to_markdown() has every column)")
    return buf.getvalue()


def show(rep, console=None, *, max_layers: int = 30, use_rich: bool | None = None,
         width: int | None = None) -> None:
    """Print the report: rich tables when rich is installed (or ``use_rich=True``), else plain text.
    Both fit the terminal's width (``width`` overrides it; rich: the console's width): prose wraps, the
    per-layer table drops its least useful columns first and abbreviates layer names from the middle,
    keeping their distinguishing end."""
    if use_rich is not False:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            if use_rich:
                raise
        else:
            show_rich(rep, console or Console(width=width), Table, max_layers)
            return
    if width is None:
        width = shutil.get_terminal_size((80, 24)).columns
    print(to_text(rep, max_layers, width), end="", file=console if hasattr(console, "write") else None)


def show_rich(rep, console, Table, max_layers: int) -> None:
    style = {"healthy": "green", "notice": "cyan", "warning": "yellow", "critical": "bold red"}
    summary = Table(title="Gradient report" + (f" (step {rep.step})" if rep.step is not None else ""),
                    show_header=False)
    summary.add_column("Metric")
    summary.add_column("Value")
    for k, v in summary_rows(rep):
        summary.add_row(k, f"[{style[rep.status]}]{v}[/]" if k == "Status" else v)
    console.print(summary)
    if rep.findings:
        issues = Table(title="Issues detected")
        for h in ("Severity", "Issue", "Affected", "Detail"):
            issues.add_column(h, overflow="fold")  # wrap long layer names, never cut them
        for f in rep.findings:
            issues.add_row(f"[{style[f.severity]}]{f.severity}[/]", f.title, _layers_text(f), f.detail)
        console.print(issues)
    for code, text, snippet in recommendations(rep):
        console.print(f"[bold]{code}[/]: {text}")
        if snippet:
            console.print(snippet, markup=False, highlight=False)
    # a rich cell costs its text + 2 padding + 1 border; the table one more border
    head, rows, more, dropped = fitted_layer_table(rep, max_layers, console.width, 3, 1)
    if rows:
        layers = Table(title="Per-layer gradients")
        for h in head:
            if h == "Layer":
                layers.add_column(h, justify="left", no_wrap=True, overflow="ellipsis")
            else:
                layers.add_column(h, justify="right", no_wrap=True)
        for row in rows:
            layers.add_row(*row)
        console.print(layers)
        if more:
            console.print(f"({more} more layers not shown)")
        if dropped:
            console.print(f"(left out to fit {console.width} columns: {', '.join(dropped)}; to_markdown() "
                          "has every column)", markup=False, highlight=False)


def abbrev(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters, shortened from the middle: dotted components between the
    first one and the last are replaced by "…" from the left, keeping numbers (the layer index), then the
    string is cut in the middle keeping more of its end, which is what tells layers apart
    (``0.layers.11.self_attn.out_proj`` -> ``0.….11.….out_proj``); the first component goes last."""
    if len(name) <= width:
        return name
    parts = name.split(".")
    keep = [True] * len(parts)
    for i in list(range(1, len(parts) - 1)) + [0]:  # the middle first, then the head
        if parts[i].isdigit() or len(parts) < 2:
            continue
        keep[i] = False
        shown, prev = [], True
        for p, k in zip(parts, keep):
            if k:
                shown.append(p)
            elif prev:
                shown.append("…")
            prev = k
        short = ".".join(shown)
        if len(short) <= width:
            return short
    if sum(keep) < len(parts):
        name = short
    if width <= 1:
        return name[-width:] if width > 0 else ""
    tail = (2 * (width - 1)) // 3
    return name[:width - 1 - tail] + "…" + name[len(name) - tail:]


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


