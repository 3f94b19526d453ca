"""The guard's modes, one file each in this folder: every module here but ``base`` defines one
:class:`~.base.Mode` subclass, found at import. Adding a mode is adding its file (plus its test and a row in
docs/guard-reference.md's Modes table and docs/layout.md); nothing else names the modes.

``MODE_CLASSES``: name -> class, the default ``"norm"`` first, then by name; ``MODES``: their names."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Mode

DEFAULT = "norm"


def find_modes(path, package: str) -> dict[str, type[Mode]]:
    """The modes the files of the package ``package`` (folder ``path``) define, name -> class, the default
    first, then by name. ImportError for a file that does not define exactly one, or a name defined twice."""
    found: dict[str, type[Mode]] = {}
    for info in pkgutil.iter_modules(path):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        classes = [c for c in vars(module).values()
                   if isinstance(c, type) and issubclass(c, Mode) and c.__module__ == module.__name__]
        if len(classes) != 1 or not classes[0].name:
            raise ImportError(f"{module.__name__}: a guard mode's file defines exactly one Mode subclass with "
                              f"a name; found {[c.__name__ for c in classes]}")
        cls = classes[0]
        if cls.name in found:
            raise ImportError(f"guard mode {cls.name!r} is defined twice: {found[cls.name].__module__} and "
                              f"{module.__name__}")
        found[cls.name] = cls
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != DEFAULT, kv[0])))


MODE_CLASSES = find_modes(__path__, __name__)
MODES = tuple(MODE_CLASSES)
