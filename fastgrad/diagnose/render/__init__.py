"""Renderings, apart from judgement: ``step_text`` (one step's report: Markdown, text, rich), ``run_text``
(a checked run: Markdown and JSON) and ``plot`` (PNG)."""
