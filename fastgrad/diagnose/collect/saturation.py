"""Activations saturated at initialisation: the share of a saturating activation's outputs that sit on its flat
tails in the forwards before the first ``backward()`` returns, that is, on the weights the script built, before
any update. A deep tanh stack whose initialisation is several times too large (or inputs that are not
normalised) puts most units there: each passes back a small fraction of its gradient, and the layers before it
see a signal the saturation has scrambled. A mixin of :class:`~fastgrad.diagnose.collect.hooks.Checker`.

Device only while the script runs: one global forward hook, removed when the first backward returns, keeps per
call of an ``nn.Tanh`` or ``nn.Sigmoid`` the share of outputs whose slope is below ``RunLimits.saturated_slope``
of the activation's largest (tanh: 1 - y^2; sigmoid: 4 y (1 - y)); ``saturation_report()`` reads them once, at
the end of the run."""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed.dtensor import is_dtensor
from ..thresholds import RunLimits

__all__ = ["SaturationReader", "slope_share"]

#: the activation calls kept at most (a first forward of a very deep or recurrent model calls more)
CALLS = 256


def slope_share(y: Tensor, kind: str, slope: float) -> Tensor:
    """Share of ``y`` (outputs of tanh, or of sigmoid when ``kind`` is "Sigmoid") whose slope is below ``slope``
    of the activation's largest, as a 0-dim float tensor on ``y``'s device (NaN counts as not saturated)."""
    y = y.detach().float()
    d = 4.0 * y * (1.0 - y) if kind == "Sigmoid" else 1.0 - y * y
    return (d < slope).float().mean()


class SaturationReader:
    def _sat_init(self) -> None:
        self._sat: list[tuple[str, str, Tensor]] = []
        self._sat_handle = None
        self.saturation: list[dict] = []

    def _sat_install(self) -> None:
        from torch.nn.modules import module as M

        self._sat_handle = M.register_module_forward_hook(self._sat_hook)

    def _sat_close(self) -> None:
        """At the first backward's return: the weights may change from here on; stop watching."""
        if self._sat_handle is not None:
            self._sat_handle.remove()
            self._sat_handle = None

    def _sat_hook(self, module, args, output) -> None:
        kind = "Tanh" if isinstance(module, torch.nn.Tanh) else (
            "Sigmoid" if isinstance(module, torch.nn.Sigmoid) else None)
        if kind is None or len(self._sat) >= CALLS or not isinstance(output, Tensor) \
                or not output.is_floating_point() or not output.numel():
            return
        try:   # never raises into the script's forward
            y = output._local_tensor if is_dtensor(output) else output
            name = (self.watcher.name_of(module) if self.watcher is not None else None) or f"<unnamed {kind}>"
            self._sat.append((name, kind, slope_share(y, kind, RunLimits.saturated_slope)))
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"saturation of {type(module).__name__}: {e}")
            self._sat_close()

    def saturation_report(self) -> list[dict]:
        """``{"module", "type", "share", "calls"}`` per activation module seen before the first backward (its
        calls' mean share), in the order first called. One sync."""
        if not self._sat:
            return []
        dev = self._sat[0][2].device
        vals = torch.stack([s.to(dev) for _, _, s in self._sat]).tolist()
        out: dict[str, dict] = {}
        for (name, kind, _), v in zip(self._sat, vals):
            e = out.setdefault(name, {"module": name, "type": kind, "share": 0.0, "calls": 0})
            e["share"] += v
            e["calls"] += 1
        self._sat = []
        return [dict(e, share=e["share"] / e["calls"]) for e in out.values()]
