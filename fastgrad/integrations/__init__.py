"""Thin, optional adapters of fastgrad's step guard to training frameworks. Each module imports its
framework when imported itself (a clear ImportError names the package if it is missing); importing
``fastgrad`` imports none of them.

* ``fastgrad.integrations.lightning.StepGuardCallback``: a Lightning ``Callback`` (automatic optimization).
* ``fastgrad.integrations.transformers.StepGuardCallback``: a ``transformers.TrainerCallback``.
* accelerate needs no adapter: ``fastgrad.StepGuard(accelerator.prepare(optimizer), ...)``.
"""
