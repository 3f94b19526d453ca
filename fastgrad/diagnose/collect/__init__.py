"""Statistics collection: what the diagnosis reads, gathered without host syncs on the training path.

- ``snapshot``: one step's statistics as host rows (``gather``: one sync);
- ``history``: a monitor's device ring buffers;
- ``watch``: the forward watcher (the first non-finite module output);
- ``nonfinite``: ``find_nonfinite`` (loss, gradients, parameters: one sync);
- ``steps``: ``StepRecord``, one step of a checked run;
- ``hooks``: the ``Checker``, the global hooks of ``python -m fastgrad.check``: backward, the step boundary
  and the flushes; its parts: ``optimizer_hooks`` (reading each optimizer step), ``naming`` (parameter and
  series names), ``interceptors`` (the red flags), ``manual`` (hand-written loops).
"""
