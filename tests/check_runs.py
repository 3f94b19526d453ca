"""What the check tests share: a script checked in this process with its own float64 truth recorded
(``tests/check_scripts/_truth.py`` writes it where ``FG_TRUTH`` points), and the report's findings and
summary rows read from its JSON."""

import json
import os
from pathlib import Path

from fastgrad import check

SCRIPTS = Path(__file__).resolve().parent / "check_scripts"


def checked_run(script: str, args, truth: Path, steps=None) -> dict:
    """``python -m fastgrad.check SCRIPT ARGS`` run in this process: the result, its JSON and markdown, the exit
    code and the truth the script recorded (None when it records none)."""
    os.environ["FG_TRUTH"] = str(truth)
    try:
        res = check.run_script(str(SCRIPTS / script), list(args), steps=steps)
    finally:
        os.environ.pop("FG_TRUTH", None)
    return {"res": res, "json": json.loads(json.dumps(res.to_dict(), default=str)), "md": res.to_markdown(),
            "rc": res.exit_code, "truth": json.loads(truth.read_text()) if truth.exists() else None}


def cached_run(cache: dict, runs: dict, name: str, tmp: Path) -> dict:
    """``checked_run`` of ``runs[name]`` (script, args), made once per ``cache``, its truth written under ``tmp``."""
    if name not in cache:
        script, args = runs[name]
        cache[name] = checked_run(script, args, tmp / f"{name}.truth.json")
    return cache[name]


def checked_once(cache: dict, tmp_path_factory, script: str, *args) -> dict:
    """``checked_run`` of ``script`` with ``args``, made once per ``cache`` (one module's tests share a run), its
    truth written in a fresh temporary folder."""
    key = (script, args)
    if key not in cache:
        cache[key] = checked_run(script, args, tmp_path_factory.mktemp(Path(script).stem) / "truth.json")
    return cache[key]


def codes(run: dict, severity=None) -> list[str]:
    return [f["code"] for f in run["json"]["findings"] if severity is None or f["severity"] == severity]


def finding(run: dict, code: str) -> dict:
    return next(f for f in run["json"]["findings"] if f["code"] == code)


def row(run: dict, metric: str) -> dict:
    return next(x for x in run["json"]["summary"] if x["metric"].startswith(metric))
