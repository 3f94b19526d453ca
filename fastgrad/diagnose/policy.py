"""What a check may leave out and what fails it, for CI: ``Policy`` (the finding codes to ignore, each with
where the choice came from, and ``fail_on``, the lowest severity that makes the exit code 1), from
``--ignore``/``--fail-on`` and from a ``fastgrad-check.toml`` beside the script (or the log)::

    fail-on = "warning"          # notice | warning | critical (the default: critical)

    [ignore]                     # one line per silenced finding, with the reason the team accepted it
    no_clipping = "the model clips inside its forward"

(``ignore = ["no_clipping"]`` works too.) An ignored finding is left out of the verdict, the exit code, the
summary and the advice, and the report lists it under "Ignored" with its reason. A code check does not know,
or a severity that is not one, is an error before anything runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .rules.registry import FINDING_CODES

__all__ = ["Policy", "PolicyError", "CONFIG_NAME", "FAIL_ON", "load_policy"]

#: the file read beside the script (or the log)
CONFIG_NAME = "fastgrad-check.toml"
#: the severities ``fail_on`` accepts, mildest first
FAIL_ON = ("notice", "warning", "critical")


class PolicyError(ValueError):
    """A bad --ignore, --fail-on or config file (the command line exits with status 2)."""


@dataclass
class Policy:
    #: code -> why it is ignored ("--ignore", or the config file's reason)
    ignore: dict[str, str] = field(default_factory=dict)
    fail_on: str = "critical"
    config: str | None = None  # the config file read, if any


def _codes(codes, where: str) -> list[str]:
    out = []
    for c in codes:
        if not isinstance(c, str) or c.strip() not in FINDING_CODES:
            raise PolicyError(f"{where}: unknown finding code {c!r} (python -m fastgrad.check --help lists them)")
        out.append(c.strip())
    return out


def _fail_on(value, where: str) -> str:
    if value not in FAIL_ON:
        raise PolicyError(f"{where}: fail-on must be one of {', '.join(FAIL_ON)}, got {value!r}")
    return value


def _read_toml(path: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise PolicyError(f"{path}: reading it needs Python 3.11 or the tomli package (pip install tomli)"
                              ) from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError) as e:
        raise PolicyError(f"{path}: cannot be read: {e}") from None


def load_policy(folder: str | None, ignore: str | None = None, fail_on: str | None = None) -> Policy:
    """The policy of a check: ``folder``'s ``fastgrad-check.toml`` (when there is one), then the command
    line's ``ignore`` ("CODE[,CODE]": added to the file's) and ``fail_on`` (replaces the file's)."""
    pol = Policy()
    path = os.path.join(folder, CONFIG_NAME) if folder is not None else None
    if path is not None and os.path.isfile(path):
        doc = _read_toml(path)
        pol.config = path
        unknown = set(doc) - {"ignore", "fail-on"}
        if unknown:
            raise PolicyError(f"{path}: unknown key(s) {', '.join(sorted(unknown))} (keys: ignore, fail-on)")
        ig = doc.get("ignore", {})
        if isinstance(ig, list):
            ig = {c: "" for c in ig}
        if not isinstance(ig, dict) or not all(isinstance(v, str) for v in ig.values()):
            raise PolicyError(f"{path}: ignore must be a list of codes or a table of code = \"reason\"")
        for c in _codes(ig, path):
            pol.ignore[c] = ig[c] or CONFIG_NAME
        if "fail-on" in doc:
            pol.fail_on = _fail_on(doc["fail-on"], path)
    if ignore:
        for c in _codes([c for c in ignore.split(",") if c.strip()], "--ignore"):
            pol.ignore.setdefault(c, "--ignore")
    if fail_on is not None:
        pol.fail_on = _fail_on(fail_on, "--fail-on")
    return pol
