"""A map keyed by object identity that lets go of its keys.

check keeps per-object state for what a script builds (optimizers, parameters, modules, guards). Keying it by
``id(obj)`` alone has two failures in scripts that build anew, as a sweep does: the state holds its objects (a
dead run's parameters, with their gradients, lived as long as the check), and CPython hands a dead object's
memory, hence its ``id()``, to a later object, which would then be read through the dead one's entry. Here each
entry holds a weak reference: it is dropped when its object dies and a lookup answers only for the very object
it was made for. Objects that cannot be weakly referenced are not kept (a lookup misses, as for a new object).
"""

from __future__ import annotations

import weakref

__all__ = ["IdentityMap"]


class IdentityMap:
    __slots__ = ("_d", "__weakref__")

    def __init__(self):
        self._d: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, obj, default=None):
        e = self._d.get(id(obj))
        return e[1] if e is not None and e[0]() is obj else default

    def __contains__(self, obj) -> bool:
        e = self._d.get(id(obj))
        return e is not None and e[0]() is obj

    def __setitem__(self, obj, value) -> None:
        key = id(obj)
        me = weakref.ref(self)

        def gone(ref, key=key):  # only the entry this reference made: a new object may hold the id by now
            m = me()
            if m is not None:
                e = m._d.get(key)
                if e is not None and e[0] is ref:
                    del m._d[key]

        try:
            self._d[key] = (weakref.ref(obj, gone), value)
        except TypeError:  # not weakly referenceable: nothing kept
            self._d.pop(key, None)

    def setdefault(self, obj, value):
        e = self._d.get(id(obj))
        if e is not None and e[0]() is obj:
            return e[1]
        self[obj] = value
        return value

    def add(self, obj) -> None:  # as a set
        self[obj] = True

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)

    def __bool__(self) -> bool:
        return bool(self._d)
