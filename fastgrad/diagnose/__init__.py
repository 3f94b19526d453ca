"""Gradient diagnosis: collection (``collect``), findings as rules (``rules``), advice (``advice``), rendering
(``render``), and the objects that wire them together: ``GradientReport`` (one step), ``GradientMonitor``
(during training), ``CheckResult``/``run_script`` (a whole script, ``python -m fastgrad.check``).

Layers, bottom first: ``thresholds``/``finding`` -> ``collect`` -> ``rules`` -> ``advice`` -> ``render`` ->
``report``/``result`` -> ``monitor``/``loggers``/``run`` -> ``fastgrad.check`` (the command line). The public
names stay where users import them: ``fastgrad.GradientMonitor``, ``fastgrad.gradient_report``,
``fastgrad.find_nonfinite``; the rest are imported from here (e.g. ``fastgrad.diagnose.collect.watch``)."""
