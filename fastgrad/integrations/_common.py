"""What the framework adapters share: the optional import, and the guard's counters as loggable numbers."""

from __future__ import annotations

import importlib


def require(module: str, package: str, what: str):
    """Import ``module`` or raise ImportError naming the pip package that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the '{package}' package, which is not installed: pip install {package}"
                          ) from e


def counters(guard, prefix: str) -> dict[str, float]:
    """The guard's counters, last norms and the ledger of the steps since the previous log as plain numbers
    (ONE device-to-host transfer), named for a logger; a value only once there is one (a step, a finite norm
    in the window)."""
    st = guard.state()
    keys = ("steps", "skipped_steps", "nonfinite_steps", "spike_steps", "clipped_steps", "consecutive_skipped",
            "longest_consecutive_skipped", "total_norm", "clipped_norm", "clip_share", "norm_p50", "norm_p90",
            "norm_p99")
    return {f"{prefix}{k}": float(st[k]) for k in keys if st.get(k) is not None}


def check_no_model(options: dict) -> None:
    if "model" in options:
        raise TypeError("StepGuardCallback(model=...): the callback guards the model the trainer trains (its "
                        "buffers are restored on a skipped step); do not pass one")


def check_hold_schedule(hold_schedule) -> bool:
    if not isinstance(hold_schedule, bool):
        raise TypeError(f"hold_schedule must be True or False, got {hold_schedule!r}")
    return hold_schedule


def hold_accelerate_schedule(wrapper, skipped: bool) -> None:
    """Make accelerate's ``AcceleratedOptimizer`` report a guard skip as a skipped step, so that what reads
    ``step_was_skipped`` (accelerate's prepared scheduler, the Hugging Face Trainer's scheduler step) holds
    back. accelerate sets the flag from its GradScaler only (``_is_overflow``, after each step; never without
    a scaler, so then this sets it every step)."""
    if not hasattr(wrapper, "_is_overflow") or not hasattr(wrapper, "step_was_skipped"):
        raise RuntimeError(
            f"hold_schedule=True needs accelerate's AcceleratedOptimizer (its step_was_skipped), but the optimizer "
            f"is a {type(wrapper).__name__}; this version of the framework is not supported: pass "
            "hold_schedule=False")
    if getattr(wrapper, "scaler", None) is None:
        wrapper._is_overflow = skipped
    elif skipped:
        wrapper._is_overflow = True


def refuse_unsafe_checkpoint(guard, framework: str) -> None:
    """Raise before a checkpoint that holds a NaN or an inf is written (one host read, at checkpoint time
    only): a rotation that keeps the last few would otherwise delete the healthy ones for it."""
    if guard is None or guard.safe_to_checkpoint():
        return
    from ..guard import GuardError

    raise GuardError(
        f"StepGuardCallback: refusing to write this {framework} checkpoint: not finite: "
        f"{', '.join(guard.nonfinite_state())}. The guard keeps a skipped step out of the weights, so this came "
        "in another way (a write outside the optimizer step, a load, a second optimizer); the checkpoints "
        "already written are untouched")
