"""``never_learns``: a trainable tensor whose gradient is exactly zero, or absent, at every step the run read,
named by its module path, whatever share of the model it is (an encoder dead from the first step, a layer cut
off from the loss). Told apart:

- zero at every step while present: in the graph, but nothing passes back to it (a ReLU that never fires, an
  op whose derivative is 0, the input of a layer that is all zero): a warning;
- absent at every step (its ``.grad`` stayed None) while the module that owns it ran in a forward (the
  watcher saw it finish): cut off from the loss, its output detached on the way (``.detach()``, ``.data``,
  ``torch.no_grad()``) or computed and dropped (``block(x)`` for ``x = block(x)``): said so, a warning;
- absent at every step and its module never ran (or a log, which cannot tell): the script never uses it in its
  graph (a module built but not called): said so, a warning too, the optimizer holds it in vain;
- frozen parameters (``requires_grad`` False) are not a finding (the summary names them), and the rows of an
  embedding a batch did not look up are not either (the tensor's gradient is nonzero where rows were looked up).

Judged over at least ``RunLimits.never_learns_steps`` reads of the tensor's optimizer; an optimizer whose every
gradient is zero is ``zero_grads``, and a clip that zeroes every gradient ``clip_zeroes``: those say it."""

from __future__ import annotations

import re

from ..finding import Finding
from .base import Rule, RunView

#: the reverse direction's recurrent weight of a bidirectional nn.RNN/LSTM/GRU layer
_REVERSE_HH = re.compile(r"weight_hh_l(\d+)_reverse$")

__all__ = ["NeverLearns", "NEVER_LEARNS", "never_learning"]


def never_learning(run: RunView, covered=()) -> tuple[list[str], list[str], list[str]]:
    """(zero, cut, unused): the trainable tensors read at ``RunLimits.never_learns_steps`` steps or more whose
    gradient was never nonzero: zero while present; absent while their module ran (cut off from the loss); absent
    and never run (or not known). Series in ``covered`` are left out. The first two are in the model's
    computation, so a loss that cannot improve through them is their doing; the last are not."""
    live = run.ctx.get("live") or {}
    ran = run.ctx.get("ran")
    ran = set(ran) if ran is not None else set()
    zero, cut, unused = [], [], []
    for name, (series, reads, present, nonzero) in live.items():
        if series in covered or reads < run.limits.never_learns_steps or nonzero:
            continue
        (zero if present else cut if name in ran else unused).append(name)
    return zero, cut, unused


class NeverLearns(Rule):
    def evaluate(self, run: RunView) -> list[Finding]:
        live = run.ctx.get("live") or {}
        # a stronger cause says it for the whole optimizer
        covered = {f.evidence.get("series") for f in run.findings if f.code == "zero_grads"}
        if any(f.code == "clip_zeroes" for f in run.findings):
            return []
        zero, cut, unused = never_learning(run, covered)
        if not zero and not cut and not unused:
            return []
        # a bias whose own layer's weight learns receives the sum of the gradients at that layer's output: zero
        # at every step means they cancel by construction (the loss is invariant to a constant shift there), not
        # a unit that never fires (that zeroes the weight's gradient too)
        # (a weight whose gradient went NaN/Inf is not evidence of anything learning)
        learns = {n for n, (_, _, _, nonzero) in live.items() if nonzero} - set(run.bad_params)
        invariant = [n for n in zero if n.endswith("bias") and n[:-4] + "weight" in learns]
        zero = [n for n in zero if n not in invariant]
        if invariant and not zero and not cut and not unused:
            return [Finding(
                self.code, "notice", f"{len(invariant)} tensor(s) the loss does not depend on: their gradient is "
                "zero by construction",
                f"{', '.join(invariant)}: an exactly zero gradient at every one of the "
                f"{max(live[n][1] for n in invariant)} step(s) read, while the weight of the same layer learns. "
                "A bias receives the sum of the gradients arriving at its layer's output; here they cancel at every "
                "step, so the loss is invariant to a constant shift of that output (a Wasserstein critic's "
                "mean(D(fake)) - mean(D(real)), a bias right before a normalisation). Nothing is dead and nothing "
                "needs initialising: the tensor simply never changes.", invariant, [],
                {"zero": [], "cut": [], "unused": [], "invariant": invariant, "variant": "invariant",
                 "steps": max(live[n][1] for n in invariant), "of": len(live)})]
        total = len(live)
        reads = max(live[n][1] for n in zero + cut + unused)
        parts = []
        # the reverse half of a bidirectional RNN read only at the last time step: there it has taken one step
        # from its zero initial state, so its recurrent weight multiplies zeros (its input weight learns)
        rev = [n for n in zero if _REVERSE_HH.search(n)
               and _REVERSE_HH.sub(lambda m: f"weight_ih_l{m.group(1)}_reverse", n) in learns]
        reverse = bool(zero) and rev == zero
        if reverse:
            parts.append(f"{len(zero)} trainable tensor(s) had an exactly zero gradient at every one of the "
                         f"{reads} step(s) read: {', '.join(zero)}, the recurrent weights of the reverse direction "
                         "of a bidirectional RNN, while its input weights learn. The loss reads the output only at "
                         "the last time step (output[-1], or output[:, -1] with batch_first), where the reverse "
                         "direction has taken a single step from its zero initial state: it has seen only the last "
                         "token, and its recurrent weight multiplies zeros.")
        elif zero:
            parts.append(f"{len(zero)} trainable tensor(s) had an exactly zero gradient at every one of the "
                         f"{reads} step(s) read: {', '.join(zero)}. They are in the loss's graph, but nothing "
                         "passes back to them (a ReLU that never fires, e.g. after a large negative bias; an op whose "
                         "derivative is 0 such as round, sign or argmax; a layer whose input is all zero), so the "
                         "optimizer never moves them.")
        if cut:
            parts.append(f"{len(cut)} trainable tensor(s) never received a gradient (their .grad stayed None at "
                         f"every step) although the modules that own them ran in forward(): {', '.join(cut)}. Their "
                         "output never reaches the loss along a path that carries a gradient: it is detached on the "
                         "way (a .detach(), .data, torch.no_grad(), a value rebuilt from .item() or .numpy()) or "
                         "computed and then dropped (block(x) where x = block(x) was meant).")
        if unused:
            parts.append(f"{len(unused)} trainable tensor(s) never received a gradient (their .grad stayed None at "
                         f"every step): {', '.join(unused)}. The script never uses them in its graph (a module "
                         "built but never called in forward()).")
        parts.append(f"{len(zero) + len(cut) + len(unused)} of the {total} trainable tensor(s) the optimizers "
                     "step; frozen parameters (requires_grad False) are not counted.")
        # the first kind present leads the title; the later ones are added by count
        lead, why = next(k for k in ((zero, "their gradient is zero at every step"),
                                     (cut, "their modules run, but no gradient comes back from the loss"),
                                     (unused, "the script never uses them in its graph")) if k[0])
        title = f"{len(lead)} tensor(s) never learn: {why}" + "".join(
            f", and {len(names)} {short}" for names, short in ((cut, "are cut off"), (unused, "are never used"))
            if names and names is not lead)
        if invariant:
            parts.append(f"Not counted: {', '.join(invariant)}, zero by construction (the loss is invariant to a "
                         "constant shift of its layer's output; the weight of that layer learns).")
        return [Finding(self.code, "warning", title, " ".join(parts), zero + cut + unused, [],
                        {"zero": zero, "cut": cut, "unused": unused, "invariant": invariant, "steps": reads,
                         "of": total} | ({"variant": "reverse_last_step"} if reverse else {}))]


NEVER_LEARNS = NeverLearns(
    "never_learns", "warning", "per trainable tensor, at how many steps its gradient was present and nonzero",
    "a trainable tensor's gradient is exactly zero, or absent (the script never uses it), at every step read; "
    "frozen parameters and unlooked-up embedding rows are not this", needs=("tensors",))
