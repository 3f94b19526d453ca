"""Targets a run moves itself: a model the script forwards but trains through no optimizer, whose parameters it
rewrites in place during the run (a DQN or actor-critic target network copied or Polyak-averaged from the
critic, an EMA teacher). A loss against such targets is bootstrapped: it can rise while the agent learns, as
its targets grow with the returns. A mixin of :class:`~fastgrad.diagnose.collect.hooks.Checker`.

Host only: the version counters (``Tensor._version``, bumped by every in-place write: ``copy_`` in
``load_state_dict``, ``mul_``/``add_``/``lerp_`` of an average) of each root module's first ``SAMPLE``
parameters, taken at the first optimizer step after the watcher saw it and compared at each later step until
they move (a model's namespace may be gone by the end of the run, so it is judged while the run is on).
``targets_moved``: the class names of the roots so judged to be targets the run moves."""

from __future__ import annotations

import itertools
import weakref

__all__ = ["MovingTargets"]

#: parameters of a root whose versions are watched: a target network rewrites all of them at once
SAMPLE = 64


class MovingTargets:
    def _note_targets(self) -> None:
        """At an optimizer step: snapshot the roots the watcher found since the last, and look for in-place
        rewrites of those snapshotted before (stopping at the first for each). Never raises: it runs at every
        step boundary, including a GradScaler's skipped step; a failure is a checker error, the run goes on."""
        try:
            self._note_targets_now()
        except Exception as e:  # noqa: BLE001 - the checker never breaks the user's step
            self.errors.append(f"step {self.steps_done}: target networks: {e}")
            self._target_versions = []   # judged no further: a partial record would misjudge

    def _note_targets_now(self) -> None:
        roots = self.watcher._roots if self.watcher is not None else ()
        while self._targets_seen < len(roots):
            root = roots[self._targets_seen]()
            self._targets_seen += 1
            if root is not None:
                ps = list(itertools.islice(root.parameters(), SAMPLE))
                if ps:
                    self._target_versions.append([weakref.ref(root), [p._version for p in ps]])
        for entry in self._target_versions:
            ref, versions = entry
            root = ref()
            if root is None or versions is None:
                continue
            ps = list(itertools.islice(root.parameters(), SAMPLE))
            if len(ps) != len(versions) or all(p._version == v for p, v in zip(ps, versions)):
                continue
            entry[1] = None   # judged: a target the run moves, or a model it trains
            held = {id(p) for r in self._opt_refs if r() is not None for g in r().param_groups for p in g["params"]}
            if not any(id(p) in held or p.grad is not None for p in ps):
                self.targets_moved.append(type(root).__name__)   # trained by no optimizer, by no backward
