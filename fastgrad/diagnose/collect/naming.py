"""Names for what a checked run steps: each parameter after the module path it has in the script's models
(the watcher's roots), each optimizer as a series ("Adam #2 (opt_g)", numbered in the order it first steps,
named after the script's variable when one holds it), the parameters the script froze (requires_grad False),
and the script's own names for its model and, in a loop without torch.optim, its learning rate (so that the
code a report advises uses them). A mixin of :class:`~fastgrad.diagnose.collect.hooks.Checker`, which owns
the state."""

from __future__ import annotations

import operator
import os
import re
import sys
import weakref

import torch

__all__ = ["ParameterNames"]

_SECOND = operator.itemgetter(1)
_LR_NAME = re.compile(r"^(lr|learning_rate|[a-z0-9_]*_lr|lr_[a-z0-9_]*)$", re.I)


#: wrappers that forward to one module they hold (DDP, DataParallel, torch.compile, Lightning Fabric), by class
#: name, and the attribute that holds it: parameters are named as in the module the script wrote, without the
#: wrapper's segment (``_forward_module.critic.0.weight`` is ``critic.0.weight``)
_WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module", "OptimizedModule": "_orig_mod",
             "_FabricModule": "_forward_module"}


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    for _ in range(len(_WRAPPERS)):
        attr = _WRAPPERS.get(type(m).__name__)
        inner = getattr(m, attr, None) if attr else None
        if not isinstance(inner, torch.nn.Module):
            break
        m = inner
    return m


def _lr_rank(name: str) -> tuple:
    return (name != "lr", name != "learning_rate", len(name), name)


class ParameterNames:
    def _named(self, opt) -> list:
        params = [p for g in opt.param_groups for p in g["params"]]
        named = self._named_cache.get(opt)
        if named is None or len(named) != len(params) or not all(map(operator.is_, params, map(_SECOND, named))):
            self._refresh_names()
            if not all(p in self._names for p in params):
                self._names_from_script(params)
            named = [(self._names.get(p, f"param_groups.{gi}.{i}"), p)
                     for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])]
            self._named_cache[opt] = named
        return named

    def _refresh_names(self) -> None:
        roots = [r() for r in self.watcher._roots] if self.watcher else []
        for k, root in enumerate(r for r in roots if r is not None):
            if not all(p in self._names for p in root.parameters()):
                # an agent that calls its layers from methods (``self.fc1(x)`` in ``pi()``, never ``forward``)
                # makes each layer a root: name them by the script's model that holds them, so two layers' weights
                # never share a name
                root = _unwrap(self._holder_of(root))
            # the first model named keeps bare names; later ones (a GAN's second, a sweep's next run) are prefixed
            prefix = "" if not self._names_given else type(root).__name__ + ":"
            for n, p in root.named_parameters():
                self._names.setdefault(p, prefix + n)
                self._names_given = True
                # frozen by the script: not a finding, but the report names them (host attribute, no sync)
                if p.requires_grad:
                    self.frozen.pop(self._names.get(p), None)
                else:
                    self.frozen[self._names.get(p)] = True
            # the script's variable for this model, by the prefix its names carry: advice about its tensors
            # names it (a GAN's critic, not the generator that ran first)
            first = next(iter(root.named_parameters()), None)
            if first is not None:
                name = self._names.get(first[1], "")
                pre = name[:len(name) - len(first[0])] if name.endswith(first[0]) else None
                models = self.script_vars.setdefault("models", {})
                if pre is not None and pre not in models:
                    models[pre] = self._var_name(root)
            # embeddings: only the rows a batch looked up get gradient, which the depth rule must know
            for m in root.modules():
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
                    self._row_sparse_ids.add(m.weight)
            self.module_types.update(type(m).__name__ for m in root.modules())

    def _holder_of(self, root: torch.nn.Module) -> torch.nn.Module:
        """The biggest module in the script's frames (``self`` of a method included) that holds ``root`` as a
        part, or ``root`` itself where none does. Host only, once per root whose parameters have no names yet."""
        best, size = root, None
        for v in self._script_modules():
            if v is not root and any(m is root for m in v.modules()):
                n = sum(1 for _ in v.parameters())
                if size is None or n > size:
                    best, size = v, n
        return best

    def _script_modules(self) -> list[torch.nn.Module]:
        """The distinct modules the script's frames hold (``_script_scopes``), innermost frame first."""
        found = []
        for scope in self._script_scopes():
            for v in list(scope.values()):
                if isinstance(v, torch.nn.Module) and all(v is not m for m in found):
                    found.append(v)
        return found

    def _names_from_script(self, params) -> None:
        """Names for parameters no forward has shown yet (an optimizer whose closure runs the model inside
        ``step()``, as LBFGS's does, is first read before the model's first call): the script's module that holds
        most of them, found in the script's frames, named as the watcher names a root (bare for the first model,
        ``Class:`` for a later one). Host only, and only while some of an optimizer's parameters have no name."""
        want = {id(p) for p in params if p not in self._names}
        found = self._script_modules()
        # the whole model before a part of it the script also keeps in a variable (``encoder = model.encoder``)
        held = sorted(((sum(id(p) in want for p in m.parameters()), i, m) for i, m in enumerate(found)),
                      key=lambda t: (-t[0], t[1]))
        for n, _, m in held:
            if not n or not want:
                break
            if not any(id(p) in want for p in m.parameters()):
                continue
            prefix = "" if not self._names_given else type(m).__name__ + ":"
            for name, p in m.named_parameters():
                if id(p) in want:
                    self._names[p] = prefix + name
                    want.discard(id(p))
            self._names_given = True

    def _series_of(self, opt) -> int:
        k = self._series.get(opt)
        if k is None:
            k = self._series[opt] = len(self.series_names)
            var = self._var_name(opt)
            self.series_names.append(f"{type(opt).__name__} #{k + 1}" + (f" ({var})" if var else ""))
            self._opt_refs.append(weakref.ref(opt))
            self._script_names()
            lr = opt.param_groups[0].get("lr") if opt.param_groups else None
            self.series_lr.append(lr if isinstance(lr, (int, float)) else None)
            self.series_sched.append(self._scheduler_var(opt))
            self.series_maximize.append(any(g.get("maximize") is True for g in opt.param_groups))
        return k

    def _scheduler_var(self, opt) -> str | None:
        """The script's variable for the learning-rate scheduler that drives ``opt`` (advice about its schedule
        names it), or None where the script keeps none."""
        for scope in self._script_scopes():
            for n, v in scope.items():
                if (getattr(v, "optimizer", None) is opt and hasattr(v, "step")
                        and not n.startswith("_") and n != "self"):
                    return n
        return None

    def _script_names(self) -> None:
        """The script's variables for its first model and, for a hand-written loop, its learning rate (a number
        in a variable named lr, learning_rate or ..._lr / lr_...), looked up once in the script's frames."""
        if "model" not in self.script_vars and self.watcher is not None:
            root = next((r() for r in self.watcher._roots if r() is not None), None)
            if root is not None:
                self.script_vars["model"] = self._var_name(root)
        if "lr" in self.script_vars:
            return
        self.script_vars["lr"] = None
        for scope in self._script_scopes():
            found = sorted((n for n, v in scope.items() if _LR_NAME.match(n) and
                            isinstance(v, (int, float)) and not isinstance(v, bool)), key=_lr_rank)
            if found:
                self.script_vars["lr"] = found[0]
                return

    def _var_name(self, obj) -> str | None:
        """The name the script gave ``obj`` (a variable in one of the script's frames on the stack)."""
        for scope in self._script_scopes():
            for n, v in scope.items():
                if v is obj and not n.startswith("_") and n != "self":
                    return n
        return None

    def _script_scopes(self):
        """The locals, then the globals, of each of the script's frames on the stack, innermost first (the
        frames of fastgrad and torch in between are skipped: only the script's names are its own)."""
        f = sys._getframe(1)
        while f is not None:
            if os.path.abspath(f.f_code.co_filename) == self.script_path:
                yield f.f_locals
                yield f.f_globals
            f = f.f_back
