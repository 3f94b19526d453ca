"""Findings as rules, evaluated after the collection: ``step`` (one step's report), ``trends`` (a series of
norms or losses) and one module per whole-run finding of ``python -m fastgrad.check`` (see ``RUN_RULES``)."""
