"""What no rule of check judges: a validation loss. The whole-run rules read the loss the script backpropagated
(or the log's training loss); a validation loss that rises while the training loss falls (overfitting) is not
checked. Every report says so in its "Not checked" section, with what the run held: a log's validation losses,
read and counted but not judged, or none at all."""

from __future__ import annotations

__all__ = ["OVERFITTING", "validation_item"]

#: the "Not checked" item's name (no finding code: no rule judges it)
OVERFITTING = "overfitting"


def validation_item(validation: tuple[str, int] | None, live: bool) -> dict:
    """The "Not checked" item about a validation loss: ``validation`` is a log's ``(column, values)`` (None
    when the run recorded none); ``live`` a run check watched itself, which never sees one."""
    if validation is not None:
        col, n = validation
        why = (f"the log's {n} validation losses (`{col}`) were read, but no rule judges a validation loss: a "
               "validation loss that rises while the training loss falls is not checked")
    elif live:
        why = ("no validation loss: a live check reads only the loss the script backpropagates, so a validation "
               "loss that rises while the training loss falls is not checked")
    else:
        why = ("no validation loss was recorded: a validation loss that rises while the training loss falls is "
               "not checked")
    return {"rule": OVERFITTING, "codes": [], "reason": why}
