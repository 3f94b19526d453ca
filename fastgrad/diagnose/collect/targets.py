"""Targets a run moves itself: a model the script forwards but trains through no optimizer, whose parameters it
rewrites in place during the run (a DQN or actor-critic target network copied or Polyak-averaged from the
critic, an EMA teacher). A loss against such targets is bootstrapped: it can rise while the agent learns, as
its targets grow with the returns. A mixin of :class:`~fastgrad.diagnose.collect.hooks.Checker`.

The candidates: each root module the watcher saw, or the largest parts of it no optimizer holds, and each
module that ran inside a root's forward but is no part of any root (a target an agent passes to its policy's
forward). Two reads of each, at every optimizer step from the first after it was seen:

- on the host: the version counters (``Tensor._version``, bumped by every in-place write: ``copy_`` in
  ``load_state_dict``, ``mul_``/``add_``/``lerp_`` of an average) of its first ``SAMPLE`` parameters (a model's
  namespace may be gone by the end of the run, so it is judged while the run is on);
- on the device, for the first ``VALUE_WATCH`` candidates: the leading values of its first parameters against
  those at the step before. A write through ``.data`` (``target.data.copy_(src.data)``, the way much RL code
  copies and averages its targets: tianshou, cleanrl) bumps no version counter; only the values show it. The
  flags are device ops, read once after the run (``_read_targets``): no sync while it runs.

A candidate that an optimizer holds, or whose parameters have gradients, is trained, never a target.
``targets_moved``: the class names of the candidates judged to be targets the run moves. ``target_syncs``: the
steps at whose boundary a target copied now and then had been rewritten since the last (a DQN's hard copy every
N steps), read after the run (``hard_copies``: an average that moves at every step marks none)."""

from __future__ import annotations

import itertools
import weakref

import torch

from ...distributed.dtensor import is_dtensor

__all__ = ["MovingTargets", "ENV_MODULES", "environment_module", "hard_copies"]

#: packages whose import means the script's agent collects its own data from an environment: its value and TD
#: targets are its own returns and estimates, and its policy loss is weighted by them, so its losses follow what
#: it collects (a longer episode, a higher return) and can rise while it learns, target network or not
ENV_MODULES = ("gymnasium", "gym", "envpool", "dm_env", "dm_control", "pettingzoo", "procgen", "minigrid",
               "ale_py", "vizdoom", "gym3", "minerl", "brax", "jumanji", "craftax")

#: parameters of a candidate whose versions are watched: a target network rewrites all of them at once
SAMPLE = 64
#: of those, the parameters whose leading values are compared, and how many values of each: an average or a
#: copy moves every value, so a few suffice
VALUE_PARAMS, VALUE_ELEMS = 8, 16
#: candidates whose values are compared at every step (a few device ops each); later ones by versions only
VALUE_WATCH = 8
#: a target that moved at no more than one step in this many is copied now and then, each move an event its loss
#: may jump at (a DQN's hard copy every N steps: hundreds in tianshou, cleanrl, minimalRL); one that moved more
#: often is averaged (Polyak). Steps are the run's, counted over all its optimizers: an agent with five (an
#: actor, a critic ensemble) that averages its targets at each critic update moves them at one step in five
HARD_COPY_EVERY = 10


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


def hard_copies(moves, watched: int) -> list[int]:
    """The steps at which a target was copied: ``moves`` (the steps at whose boundary it had moved) when they are
    sparse, at most one in ``HARD_COPY_EVERY`` of the ``watched`` boundaries; none for a target that moved more
    often (an average: its moves are no events)."""
    moves = sorted(set(moves))
    return moves if moves and len(moves) * HARD_COPY_EVERY <= watched else []


WATCHING, MOVING, TRAINED = "watching", "moving", "trained"


class _Watched:
    """One candidate target, and what the step boundaries showed of it."""
    __slots__ = ("ref", "name", "versions", "last", "flags", "flag_steps", "start", "moves", "state")

    def __init__(self, m: torch.nn.Module, ps: list, step: int, values: bool):
        self.ref, self.name = weakref.ref(m), type(m).__name__
        self.versions = [p._version for p in ps]
        self.last = _values(ps) if values else None   # device: its leading values at the last boundary
        self.flags = None          # device bools, one per boundary compared: the values had moved since the last
        self.flag_steps: list[int] = []               # host: the step of each flag
        self.start = step          # the boundary of its first snapshot
        self.moves: list[int] = []  # host: the steps at whose boundary its versions had moved
        self.state = WATCHING      # until judged: MOVING (a target the run moves) or TRAINED (no target)

    def flag(self, step: int, moved: torch.Tensor) -> None:
        """Record a device flag for ``step`` without reading it (the buffer grows by doubling, on the device)."""
        n = len(self.flag_steps)
        if self.flags is None:
            self.flags = torch.zeros(64, dtype=torch.bool, device=moved.device)
        elif n == len(self.flags):
            self.flags = torch.cat([self.flags, torch.zeros_like(self.flags)])
        self.flags[n] = moved
        self.flag_steps.append(step)


class MovingTargets:
    def _targets_init(self) -> None:
        self._watched: list[_Watched] = []
        self._targets_seen = 0   # roots of the watcher's looked at
        self._loose_seen = 0     # loose modules of the watcher's looked at
        self._target_ids: set[int] = set()   # ids of the modules in a candidate (each looked at once)
        self.targets_moved: list[str] = []   # candidates the script rewrote in place, trained by no optimizer
        self.target_syncs: list[int] = []    # the hard copies' steps (after the run)

    def _note_targets(self) -> None:
        """At an optimizer step: snapshot the candidates the watcher found since the last, and compare those
        snapshotted before. Never raises: it runs at every step boundary, including a GradScaler's skipped step; a
        failure is a checker error, the run goes on."""
        try:
            self._note_targets_now()
        except Exception as e:  # noqa: BLE001 - the checker never breaks the user's step
            self.errors.append(f"step {self.steps_done}: target networks: {e}")
            self._watched = []   # judged no further: a partial record would misjudge

    def _held(self) -> set[int]:
        """The ids of every parameter an optimizer of the run holds."""
        return {id(p) for r in self._opt_refs if r() is not None for g in r().param_groups for p in g["params"]}

    def _new_candidates(self) -> list[torch.nn.Module]:
        """The modules the watcher saw since the last step that may be targets (each module looked at once)."""
        w = self.watcher
        if w is None:
            return []
        fresh = []
        while self._targets_seen < len(w._roots):
            fresh.append(w._roots[self._targets_seen]())
            self._targets_seen += 1
        loose = [r() for r in w._loose[self._loose_seen:]]
        self._loose_seen = len(w._loose)
        # of the loose ones the largest: a module that ran inside a forward has its own parts run inside it too
        inner = {id(c) for m in loose if m is not None for c in m.modules() if c is not m}
        fresh += [m for m in loose if m is not None and id(m) not in inner]
        fresh = [m for m in fresh if m is not None and id(m) not in self._target_ids]
        if not fresh:
            return []
        held = self._held()
        out = []
        for m in fresh:
            self._target_ids.update(id(c) for c in m.modules())
            out += _candidates(m, held)
        return out

    def _note_targets_now(self) -> None:
        step = self.steps_done
        for m in self._new_candidates():
            ps = list(itertools.islice(m.parameters(), SAMPLE))
            if ps:
                valued = sum(e.last is not None for e in self._watched) < VALUE_WATCH
                self._watched.append(_Watched(m, ps, step, valued))
        held = None   # built once per step, at the first candidate that asks

        def trained(ps) -> bool:
            nonlocal held
            if held is None:
                held = self._held()
            return any(id(p) in held or p.grad is not None for p in ps)
        keep = []
        for e in self._watched:
            root = e.ref()
            if e.state == TRAINED or (root is None and e.state == WATCHING and not e.flag_steps):
                continue   # no target, or gone with nothing to read: forgotten
            keep.append(e)
            if root is None:
                continue
            ps = list(itertools.islice(root.parameters(), SAMPLE))
            if len(ps) != len(e.versions):
                continue
            versions = [p._version for p in ps]
            if versions != e.versions:
                e.versions = versions
                if e.state == WATCHING:
                    if trained(ps):   # trained by no optimizer but by a backward: no target
                        e.state = TRAINED
                        continue
                    e.state = MOVING
                    self.targets_moved.append(e.name)
                e.moves.append(step)
            elif e.state == WATCHING and e.last is not None:
                if trained(ps):       # trained by hand through .data: it has gradients
                    e.state = TRAINED
                    continue
                now = _values(ps)
                if now is not None and now.shape == e.last.shape:
                    # NaN where it was NaN is no move
                    e.flag(step, ((now != e.last) & ~(now.isnan() & e.last.isnan())).any())
                    e.last = now
        self._watched = keep

    def _read_targets(self) -> None:
        """After the run: the candidates whose values moved with no version counter moving (one read), and the
        steps of the hard copies of every target the run moved."""
        pend = [e for e in self._watched if e.flag_steps and e.state != TRAINED]
        if pend:
            dev = pend[0].flags.device
            flags = torch.cat([e.flags[:len(e.flag_steps)].to(dev) for e in pend]).tolist()
            i = 0
            for e in pend:
                moved = [s for s, f in zip(e.flag_steps, flags[i:i + len(e.flag_steps)]) if f]
                i += len(e.flag_steps)
                if moved and e.state == WATCHING:
                    e.state = MOVING
                    self.targets_moved.append(e.name)
                e.moves += moved
        syncs = set()
        for e in self._watched:
            if e.state == MOVING:
                syncs.update(hard_copies(e.moves, self.steps_done - e.start))
        self.target_syncs = sorted(syncs)


def environment_module(modules=None) -> str | None:
    """The first of ``ENV_MODULES`` imported in this process (``sys.modules``; fastgrad imports none of them), or
    None: the checked script steps an RL environment."""
    import sys

    mods = sys.modules if modules is None else modules
    return next((m for m in ENV_MODULES if m in mods), None)
