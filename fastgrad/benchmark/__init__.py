"""The benchmark behind ``python -m fastgrad.bench``: model-shaped workloads (``workloads``), the timed ops and
their torch baselines (``ops``), interleaved timing with medians and spreads (``timing``), the run itself
(``runner``) and its outputs (``report``). Part of the installed package, so the CLI works from any directory;
the pytest-benchmark cases and the committed results live in the repository's ``benchmarks/`` folder."""
