"""A finished run's logs as check's step records: ``read_log(path, columns)`` reads a Hugging Face
``trainer_state.json`` (its ``log_history``), a Lightning ``CSVLogger`` ``metrics.csv``, TensorBoard event files
(with the ``tensorboard`` package) or any CSV whose columns are recognised by name, and returns a ``LogRun``:
one ``StepRecord`` per logged training step, with the loss, the gradient norm and the learning rate the log
holds. The whole-run rules then judge it with the code that judges a live run (``fastgrad.diagnose.result.
build_log_result``).

A column is recognised by its name, lower-cased, after the usual prefixes (``train/``, ``train_``,
``training/``, ``trainer/``) and Lightning's ``_step`` suffix are taken off: ``loss``; ``grad_norm`` (also
``gradient_norm``, ``total_grad_norm``, Lightning's ``grad_2.0_norm_total``); ``learning_rate`` or ``lr`` (also
``lr-<Optimizer>`` from Lightning's ``LearningRateMonitor``); ``step`` or ``global_step`` (also W&B's ``_step``).
``columns`` names them where the log calls them something else. A validation loss (``eval_loss``, ``val_loss``,
``valid_loss``, ``validation_loss``, under the same prefixes and ``/loss`` forms) is counted, not judged: the
report says that no rule judged it (``LogRun.validation``). Every problem (a file it cannot read, a
column it cannot find, two columns that both look like the loss, a value that is not a number) is a
``LogError`` raised before anything is judged."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
from dataclasses import dataclass, field

from .steps import StepRecord

__all__ = ["LogError", "LogRun", "ROLES", "read_log", "parse_columns"]

#: what a log can tell check, and the names a column of each is recognised by (after ``_normal``)
ROLES = {
    "loss": ("loss",),
    "grad_norm": ("grad_norm", "gradient_norm", "total_grad_norm", "grad_norm_total", "grad_2.0_norm_total"),
    "lr": ("learning_rate", "lr"),
    "step": ("step", "global_step", "_step"),
}
_PREFIXES = ("train/", "training/", "trainer/", "train_", "training_")
#: a validation loss's names (after ``_normal``; Lightning's epoch aggregate too)
VALIDATION = ("eval_loss", "val_loss", "valid_loss", "validation_loss", "eval/loss", "val/loss", "valid/loss",
              "validation/loss", "val_loss_epoch")


class LogError(ValueError):
    """A log that cannot be judged, and why (the command line prints it and exits with status 2)."""


@dataclass
class LogRun:
    """A run read from its logs: ``steps`` (one per logged training step, oldest first), the log's ``kind``
    ("hf", "lightning", "tensorboard", "csv"), the column each role was read from (``columns``) and the
    roles the log does not hold (``absent``), and its validation loss: ``(column, values)``, None without one."""

    path: str
    kind: str
    steps: list[StepRecord]
    columns: dict[str, str] = field(default_factory=dict)
    absent: frozenset = frozenset()
    validation: tuple[str, int] | None = None


def parse_columns(text: str | None) -> dict[str, str]:
    """``"loss=train/total,lr=lr_0"`` -> ``{"loss": "train/total", "lr": "lr_0"}``; a bad item is a LogError."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        role, eq, name = item.partition("=")
        role, name = role.strip(), name.strip()
        if not eq or not name:
            raise LogError(f"--columns: {item.strip()!r} is not ROLE=COLUMN (roles: {', '.join(ROLES)})")
        if role not in ROLES:
            raise LogError(f"--columns: unknown role {role!r} (roles: {', '.join(ROLES)})")
        out[role] = name
    return out


def _normal(name: str) -> str:
    n = name.strip().lower()
    for p in _PREFIXES:
        if n.startswith(p) and len(n) > len(p):
            n = n[len(p):]
            break
    if n.endswith("_step") and n not in ("global_step", "_step"):
        n = n[:-len("_step")]
    if n.startswith("lr-"):  # Lightning's LearningRateMonitor: lr-<optimizer class>
        n = "lr"
    return n


def _pick(names: list[str], given: dict[str, str], where: str) -> dict[str, str]:
    """The column of each role: the one ``given`` names, else the one whose name is recognised."""
    out = {}
    for role, known in ROLES.items():
        if role in given:
            if given[role] not in names:
                raise LogError(f"{where}: no column {given[role]!r} (given for {role} with --columns); its "
                               f"columns are: {', '.join(names) or 'none'}")
            out[role] = given[role]
            continue
        hits = [n for n in names if _normal(n) in known]
        if len(hits) > 1:
            raise LogError(f"{where}: {len(hits)} columns could be the {role} ({', '.join(hits)}); name the one "
                           f"to use with --columns {role}=NAME")
        if hits:
            out[role] = hits[0]
    if "loss" not in out and "grad_norm" not in out:
        raise LogError(f"{where}: no loss or gradient norm column found among: {', '.join(names) or 'none'}; name "
                       "them with --columns loss=NAME,grad_norm=NAME")
    return out


def _validation(names: list[str], values) -> tuple[str, int] | None:
    """The log's validation-loss column and how many values it holds (``values(column)``), None without one."""
    col = next((n for n in names if _normal(n) in VALIDATION), None)
    if col is None:
        return None
    n = values(col)
    return (col, n) if n else None


def _number(value, col: str, where: str) -> float | None:
    """A logged value as a float (NaN and Inf kept: they are evidence); None where the row has none."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise LogError(f"{where}: column {col!r} holds {value!r}, not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise LogError(f"{where}: column {col!r} holds {value!r}, not a number") from None


def _records(rows: list[tuple[float | None, dict]], cols: dict[str, str], where: str, offset: int = 0
             ) -> list[StepRecord]:
    """One record per step from ``(step or None, {column: value})`` rows: rows of one step are merged (a
    Lightning CSV writes the loss, the norm and the learning rate of a step on separate rows); steps with
    neither a loss nor a norm (validation rows, a learning rate alone) are not training steps."""
    by_step: dict[int, dict[str, float]] = {}
    for i, (step, values) in enumerate(rows, 1):
        s = i if step is None else step
        if s != int(s) or not math.isfinite(s):
            raise LogError(f"{where}: step {s!r} is not a whole number")
        got = by_step.setdefault(int(s) + offset, {})
        for role in ("loss", "grad_norm", "lr"):
            if role in cols:
                v = _number(values.get(cols[role]), cols[role], where)
                if v is not None:
                    got.setdefault(role, v)
    out = []
    for s in sorted(by_step):
        v = by_step[s]
        if "loss" not in v and "grad_norm" not in v:
            continue
        norm = v.get("grad_norm", math.nan)
        # a logged norm that is not finite: the gradients were (a log cannot tell an overflowed sum of squares)
        out.append(StepRecord(step=s, has_loss="loss" in v, loss=v.get("loss"), lr=v.get("lr"),
                              total_norm=norm, nonfinite=0.0 if math.isfinite(norm) or "grad_norm" not in v else 1.0,
                              norm_read="grad_norm" in v, source="log"))
    if not out:
        raise LogError(f"{where}: no training step in the log (no row with a loss or a gradient norm)")
    return out


def _hf(path: str, given: dict[str, str]) -> LogRun:
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise LogError(f"{path}: cannot be read as JSON: {e}") from None
    hist = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(hist, list):
        raise LogError(f"{path}: not a Hugging Face trainer_state.json (no log_history list)")
    names = list(dict.fromkeys(k for row in hist if isinstance(row, dict) for k in row))
    # the Trainer's last row sums the run up (train_loss, train_runtime): not a step
    rows_in = [r for r in hist if isinstance(r, dict) and "train_runtime" not in r]
    names = [n for n in names if n not in ("train_loss", "train_runtime")]
    cols = _pick(names, given, path)
    rows = [(_number(r.get(cols["step"]), cols["step"], path) if "step" in cols else None, r) for r in rows_in]
    val = _validation(names, lambda c: sum(1 for r in rows_in if r.get(c) is not None))
    return LogRun(path, "hf", _records(rows, cols, path), cols, frozenset(ROLES) - set(cols), val)


def _csv(path: str, given: dict[str, str], kind: str) -> LogRun:
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            names = list(reader.fieldnames or [])
            data = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise LogError(f"{path}: cannot be read as CSV: {e}") from None
    if not names:
        raise LogError(f"{path}: empty, no header row")
    cols = _pick(names, given, path)
    rows = [(_number(r.get(cols["step"]), cols["step"], path) if "step" in cols else None, r) for r in data]
    # Lightning logs a training step under the count of steps taken before it (step 0 is the first)
    offset = 1 if kind == "lightning" and "step" in cols and "step" not in given else 0
    val = _validation(names, lambda c: sum(1 for r in data if (r.get(c) or "").strip()))
    return LogRun(path, kind, _records(rows, cols, path, offset), cols, frozenset(ROLES) - set(cols), val)


def _tensorboard(files: list[str], given: dict[str, str], where: str) -> LogRun:
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError:
        raise LogError(f"{where}: reading TensorBoard event files needs the tensorboard package: pip install "
                       "tensorboard (or pip install 'fastgrad[logs]')") from None
    series: dict[str, dict[int, float]] = {}
    for fn in sorted(files):
        try:
            for ev in EventFileLoader(fn).Load():
                for v in ev.summary.value:
                    if v.HasField("simple_value"):
                        x = v.simple_value
                    elif v.HasField("tensor") and v.tensor.float_val:
                        x = v.tensor.float_val[0]
                    elif v.HasField("tensor") and v.tensor.double_val:
                        x = v.tensor.double_val[0]
                    else:
                        continue
                    series.setdefault(v.tag, {})[int(ev.step)] = float(x)
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: say which
            raise LogError(f"{fn}: cannot be read as a TensorBoard event file: {e}") from None
    names = list(series)
    if "step" in given:
        raise LogError(f"{where}: --columns step= does not apply to TensorBoard files (each value has its step)")
    cols = _pick(names, given, where)
    steps = sorted({s for c in cols.values() for s in series[c]})
    rows = [(float(s), {c: series[c].get(s) for c in cols.values()}) for s in steps]
    cols["step"] = "(event step)"
    val = _validation(names, lambda c: len(series[c]))
    return LogRun(where, "tensorboard", _records(rows, cols, where), cols, frozenset(ROLES) - set(cols), val)


def _event_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "**", "*tfevents*"), recursive=True))


def read_log(path: str, columns: dict[str, str] | None = None) -> LogRun:
    """The run that the log at ``path`` (a file, or a folder holding one kind of log) records."""
    given = dict(columns or {})
    if not os.path.exists(path):
        raise LogError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        found = {k: v for k, v in (
            ("hf", [p for p in (os.path.join(path, "trainer_state.json"),) if os.path.isfile(p)]),
            ("lightning", [p for p in (os.path.join(path, "metrics.csv"),) if os.path.isfile(p)]),
            ("tensorboard", _event_files(path))) if v}
        if not found:
            raise LogError(f"{path}: a folder with no log check reads (trainer_state.json, metrics.csv, TensorBoard "
                           "event files); give the log file itself")
        if len(found) > 1:
            raise LogError(f"{path}: holds several logs ({', '.join(sorted(found))}); give one file")
        kind, files = next(iter(found.items()))
        if kind == "tensorboard":
            if len({os.path.dirname(f) for f in files}) > 1:
                raise LogError(f"{path}: TensorBoard event files of several runs ("
                               + ", ".join(sorted({os.path.relpath(os.path.dirname(f), path) for f in files}))
                               + "); give one run's folder")
            return _tensorboard(files, given, path)
        path = files[0]
    name = os.path.basename(path)
    if "tfevents" in name:
        return _tensorboard([path], given, path)
    if name.endswith(".json"):
        return _hf(path, given)
    if name.endswith(".csv"):
        return _csv(path, given, "lightning" if name == "metrics.csv" else "csv")
    raise LogError(f"{path}: not a log check reads (a trainer_state.json, a .csv, or a TensorBoard event file)")
