"""Targets a run moves itself: a model the script forwards but trains through no optimizer, whose parameters it
rewrites in place during the run (a DQN or actor-critic target network copied or Polyak-averaged from the
critic, an EMA teacher). A loss against such targets is bootstrapped: it can rise while the agent learns, as
its targets grow with the returns. A mixin of :class:`~fastgrad.diagnose.collect.hooks.Checker`.

Two reads of each root module the watcher saw, from the first optimizer step after it saw it:

- on the host, at every step: the version counters (``Tensor._version``, bumped by every in-place write:
  ``copy_`` in ``load_state_dict``, ``mul_``/``add_``/``lerp_`` of an average) of its first ``SAMPLE``
  parameters, until they move (a model's namespace may be gone by the end of the run, so it is judged while the
  run is on);
- on the device, at the steps whose update is measured: the leading values of its first parameters against
  their copy from that first step. A write through ``.data`` (``target.data.copy_(tau * p.data + ...)``, the
  way much RL code averages its targets) bumps no version counter; only the values show it. The flags are
  device ops, read once after the run (``_read_targets``): no sync while it runs.

A root that an optimizer holds, or whose parameters have gradients, is trained, never a target.
``targets_moved``: the class names of the roots so judged to be targets the run moves. Once judged by its version
counters, a target's versions are read on at every step: ``target_syncs``, the steps at whose boundary they had
moved since the last (a DQN's hard copy every N steps; a Polyak average moves them at every step)."""

from __future__ import annotations

import itertools
import weakref

import torch

from ...distributed.dtensor import is_dtensor
from .buffers import sampled

__all__ = ["MovingTargets", "ENV_MODULES", "environment_module"]

#: packages whose import means the script's agent collects its own data from an environment: its value and TD
#: targets are its own returns and estimates, and its policy loss is weighted by them, so its losses follow what
#: it collects (a longer episode, a higher return) and can rise while it learns, target network or not
ENV_MODULES = ("gymnasium", "gym", "envpool", "dm_env", "dm_control", "pettingzoo", "procgen", "minigrid",
               "ale_py", "vizdoom", "gym3", "minerl", "brax", "jumanji", "craftax")

#: parameters of a root whose versions are watched: a target network rewrites all of them at once
SAMPLE = 64
#: of those, the parameters whose leading values are compared, and how many values of each: an average or a
#: copy moves every value, so a few suffice
VALUE_PARAMS, VALUE_ELEMS = 8, 16


def _values(ps) -> torch.Tensor | None:
    """A float64 device copy of the leading values of the first parameters (device ops only)."""
    # the first parameter's device only (no copy between devices; a meta tensor holds no values)
    dev = ps[0].device if ps else None
    vs = [_lead(p.detach()) for p in ps[:VALUE_PARAMS] if not is_dtensor(p) and p.numel() and p.is_floating_point()
          and p.device == dev and dev.type != "meta"]
    if not vs:
        return None
    return torch.cat([v.to(torch.float64) for v in vs])


def _lead(t: torch.Tensor) -> torch.Tensor:
    """The first row's leading values: a view, never a copy of a large non-contiguous parameter."""
    while t.dim() > 1:
        t = t[0]
    return t.reshape(-1)[:VALUE_ELEMS]


def _candidates(root: torch.nn.Module, held: set[int]) -> list[torch.nn.Module]:
    """The modules of ``root`` that may be targets: ``root`` itself where no optimizer holds any of its
    parameters; else each largest part of it none of whose parameters an optimizer holds (the target network an
    agent keeps beside its online one in one module: tianshou's ``model_old``, SB3's ``q_net_target``)."""
    def free(m):
        return not any(id(p) in held for p in m.parameters())
    if free(root):
        return [root]
    out = []
    todo = list(root.children())
    while todo:
        m = todo.pop(0)
        if free(m):
            if next(m.parameters(), None) is not None:
                out.append(m)
        else:
            todo.extend(m.children())
    return out


class MovingTargets:
    # an entry per root: [weak ref, version counters (None once judged), first values (device), moved (device
    # bool, None until compared), class name]

    def _note_targets(self) -> None:
        """At an optimizer step: snapshot the roots the watcher found since the last, and look for in-place
        rewrites of those snapshotted before (stopping at the first for each). Never raises: it runs at every
        step boundary, including a GradScaler's skipped step; a failure is a checker error, the run goes on."""
        try:
            self._note_targets_now()
        except Exception as e:  # noqa: BLE001 - the checker never breaks the user's step
            self.errors.append(f"step {self.steps_done}: target networks: {e}")
            self._target_versions = self._syncing = []   # judged no further: a partial record would misjudge

    def _held(self) -> set[int]:
        """The ids of every parameter an optimizer of the run holds."""
        return {id(p) for r in self._opt_refs if r() is not None for g in r().param_groups for p in g["params"]}

    def _note_targets_now(self) -> None:
        roots = self.watcher._roots if self.watcher is not None else ()
        held = None   # built once per step, at the first entry that asks
        while self._targets_seen < len(roots):
            root = roots[self._targets_seen]()
            self._targets_seen += 1
            if root is None:
                continue
            if held is None:
                held = self._held()
            for m in _candidates(root, held):
                ps = list(itertools.islice(m.parameters(), SAMPLE))
                if ps:
                    self._target_versions.append([weakref.ref(m), [p._version for p in ps], _values(ps), None,
                                                  type(m).__name__])
        compare = sampled(self.steps_done)

        def trained(ps) -> bool:
            nonlocal held
            if held is None:
                held = self._held()
            return any(id(p) in held or p.grad is not None for p in ps)
        for entry in self._target_versions:
            ref, versions, first = entry[0], entry[1], entry[2]
            root = ref()
            if root is None or versions is None:
                continue
            ps = list(itertools.islice(root.parameters(), SAMPLE))
            if len(ps) != len(versions):
                continue
            if all(p._version == v for p, v in zip(ps, versions)):
                if compare and first is not None:
                    if trained(ps):   # trained by hand through .data: it has gradients
                        entry[1] = entry[3] = None
                        continue
                    now = _values(ps)
                    if now is not None and now.shape == first.shape:
                        # NaN where it was NaN is no move
                        moved = ((now != first) & ~(now.isnan() & first.isnan())).any()
                        entry[3] = moved if entry[3] is None else entry[3] | moved
                continue
            entry[1] = entry[3] = None   # judged: a target the run moves, or a model it trains
            if not trained(ps):
                self.targets_moved.append(entry[4])   # trained by no optimizer, by no backward
                self._syncing.append([ref, [p._version for p in ps]])
                self._note_sync()
        for entry in self._syncing:
            root = entry[0]()
            ps = list(itertools.islice(root.parameters(), SAMPLE)) if root is not None else []
            if len(ps) == len(entry[1]) and any(p._version != v for p, v in zip(ps, entry[1])):
                entry[1] = [p._version for p in ps]
                self._note_sync()

    def _note_sync(self) -> None:
        if not self.target_syncs or self.target_syncs[-1] != self.steps_done:
            self.target_syncs.append(self.steps_done)

    def _read_targets(self) -> None:
        """After the run: the roots whose values moved with no version counter moving (one read)."""
        pend = [e for e in self._target_versions if e[1] is not None and e[3] is not None]
        if not pend:
            return
        flags = torch.stack([e[3].to(pend[0][3].device) for e in pend]).tolist()
        for entry, moved in zip(pend, flags):
            if moved:
                entry[1] = None
                self.targets_moved.append(entry[4])


def environment_module(modules=None) -> str | None:
    """The first of ``ENV_MODULES`` imported in this process (``sys.modules``; fastgrad imports none of them), or
    None: the checked script steps an RL environment."""
    import sys

    mods = sys.modules if modules is None else modules
    return next((m for m in ENV_MODULES if m in mods), None)
