"""The one base class of the errors layerdiv reports to a user as one line.

Every error that bad input, a refused store or an unusable model causes derives from
:class:`LayerdivError`; the command line prints its message on one line and exits 1, and never
shows a traceback for it.
"""

import re


class LayerdivError(Exception):
    """Bad input or data that cannot be trusted: the message says what is wrong and what to do."""


class DecompositionError(LayerdivError, RuntimeError):
    """A forward pass cannot be measured as captured: the components do not add up to the
    model's logits, a value is NaN/Inf, or a capture saw no pass (raised by extract's captures
    and the measurements' hooks)."""


class LayerdivWarning(UserWarning):
    """Something an analysis could not compute (a table left empty, rows filtered out): the
    message says why and how to get it. ``Results.notes`` keeps the same lines."""


def one_line(err: BaseException) -> str:
    """An error message on one line: DuckDB's source excerpt (``LINE 1: ...`` and the caret
    under it) is dropped, the remaining lines are joined."""
    lines = [ln.strip() for ln in str(err).splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("LINE ") and set(ln) != {"^"}]
    return re.sub(r"\s+", " ", " ".join(kept)) or type(err).__name__
