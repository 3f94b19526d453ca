"""``fastgrad.watch``: where ``ForwardWatcher`` has always been imported from; the code lives in
``fastgrad.diagnose.collect.watch``."""

from .diagnose.collect.watch import ForwardWatcher, NonFiniteOrigin

__all__ = ["ForwardWatcher", "NonFiniteOrigin"]
