"""``fastgrad.check_report``: the report of ``python -m fastgrad.check`` moved to ``fastgrad.diagnose``
(``result``: ``CheckResult`` and ``build_result``; ``collect.steps``: ``StepRecord``; ``rules``: the findings;
``render.run_text``: Markdown and JSON). This module re-exports those names."""

from .diagnose.collect.steps import StepRecord
from .diagnose.result import CheckResult, build_result

__all__ = ["StepRecord", "CheckResult", "build_result"]
