"""The monitor's loggers: TensorBoard, Weights & Biases, ``logging``, CSV files, callables. Each logger is
checked when the monitor is built (``check_logger``), not at the first logging step (maybe hours later);
``Loggers.emit`` sends one report to each, duck-typed."""

from __future__ import annotations

import csv
import logging
import math
import os


__all__ = ["check_logger", "Loggers"]

_CSV_FIELDS = ["step", "status", "total_norm", "max_abs", "nan", "inf", "zero_fraction", "param_norm",
               "grad_param_ratio", "loss", "findings", "skipped_steps"]



def check_logger(lg) -> None:
    """Refuse, when the monitor is built, a logger that would fail at the first logging step (maybe hours
    later). Accepts what ``GradientMonitor._emit`` can drive."""
    if isinstance(lg, type):
        raise TypeError(f"unsupported logger {lg.__name__}: a class, not an instance; pass e.g. {lg.__name__}(...)")
    if hasattr(lg, "add_scalar") or isinstance(lg, logging.Logger):
        return
    if hasattr(lg, "log") and callable(lg.log):
        return
    if hasattr(lg, "write"):
        if not callable(lg.write):
            raise TypeError(f"logger {lg!r}: its 'write' attribute is not callable; pass an open text file")
        return
    if isinstance(lg, (str, os.PathLike)):
        path = os.fspath(lg)
        if not path:
            raise ValueError("logger: an empty CSV path; pass a file name such as 'grad_health.csv'")
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"logger: CSV path {path!r} is a directory; name a file inside it, e.g. "
                             f"{os.path.join(path, 'grad_health.csv')!r}")
        if not os.path.isdir(folder):
            raise ValueError(f"logger: the folder of the CSV path {path!r} does not exist ({folder}); create it "
                             f"first (os.makedirs({folder!r}, exist_ok=True)) or pick another path")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise ValueError(f"logger: the CSV path {path!r} is not writable")
        return
    if callable(lg) and not isinstance(lg, type):
        return
    raise TypeError(
        f"unsupported logger {lg!r} of type {type(lg).__name__}: pass a TensorBoard SummaryWriter (has "
        "add_scalar), a wandb run (has log(dict)), a logging.Logger, a CSV path or open text file, a callable "
        "f(metrics: dict, step: int), a list of these, or None")



class Loggers:
    """The loggers of one monitor, and the CSV files it opened itself."""

    def __init__(self, loggers: list):
        for lg in loggers:
            check_logger(lg)
        self.items = list(loggers)
        self._csv_files: dict[int, tuple] = {}

    def emit(self, report, new_steps, loss_now: float, per_layer: bool) -> None:
        for lg in self.items:
            self._emit(lg, report, new_steps, loss_now, per_layer)

    def _emit(self, lg, report, new_steps, loss_now: float, per_layer: bool) -> None:
        step = report.step
        scalars = report.scalars(per_layer=per_layer)
        if hasattr(lg, "add_scalar"):  # TensorBoard SummaryWriter (or tensorboardX)
            # Full-resolution norm curve from the ring buffer: no extra sync, steps written after the fact.
            for s, v in new_steps:
                lg.add_scalar("grad/total_norm", v, s)
            for tag, v in scalars.items():
                if tag != "grad/total_norm":
                    lg.add_scalar(tag, v, step)
            if not report.healthy and hasattr(lg, "add_text"):
                lg.add_text("grad/report", report.to_markdown(), step)
        elif isinstance(lg, logging.Logger):
            level = {"healthy": logging.DEBUG, "notice": logging.INFO, "warning": logging.WARNING,
                     "critical": logging.ERROR}[report.status]
            lg.log(level, "step %d: gradient status %s, total norm %.4g%s", step, report.status,
                   report.total_norm, "".join(f"; {f.severity}: {f.title}" for f in report.findings))
        elif hasattr(lg, "log") and callable(lg.log):  # a wandb run: its step counter is its own
            lg.log(scalars | {"grad/step": step, "grad/status": report.status})
        elif isinstance(lg, (str, os.PathLike)) or hasattr(lg, "write"):
            self._write_csv(lg, report, loss_now)
        elif callable(lg):
            lg(scalars | {"grad/status": report.status}, step)
        else:
            raise TypeError(f"unsupported logger of type {type(lg).__name__}")

    def _write_csv(self, target, report, loss_now: float) -> None:
        key = id(target)
        if key not in self._csv_files:
            if hasattr(target, "write"):
                fh, own = target, False
                empty = not getattr(target, "tell", lambda: 0)()
            else:
                empty = not os.path.exists(target) or os.path.getsize(target) == 0
                fh, own = open(target, "a", newline=""), True
            w = csv.DictWriter(fh, fieldnames=_CSV_FIELDS)
            if empty:
                w.writeheader()
            self._csv_files[key] = (fh, w, own)
        fh, w, _ = self._csv_files[key]
        d = report.to_dict()
        w.writerow({
            "step": report.step, "status": report.status, "total_norm": report.total_norm,
            "max_abs": report.max_abs, "nan": report.nan, "inf": report.inf, "zero_fraction": d["zero_fraction"],
            "param_norm": "" if report.param_norm is None else report.param_norm,
            "grad_param_ratio": "" if report.ratio is None else report.ratio,
            "loss": "" if math.isnan(loss_now) else loss_now, "findings": ";".join(report.codes()),
            "skipped_steps": "" if report.skipped_steps is None else report.skipped_steps,
        })
        fh.flush()

    def close(self) -> None:
        """Close the CSV files the monitor opened itself."""
        for fh, _, own in self._csv_files.values():
            if own:
                fh.close()
        self._csv_files.clear()
