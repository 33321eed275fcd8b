"""pydantic's validation errors in words a user reads: `field: message`, the field that failed named once.

Pure: no I/O.
"""

from __future__ import annotations

from pydantic import ValidationError

_DIST_TAGS = frozenset({"lognormal", "constant", "uniform", "empirical"})  # a distribution's `dist`


def validation_messages(exc: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """(field, message) per pydantic error, in words: no "Value error," prefix, no discriminator tag
    in the path."""
    found = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p in _DIST_TAGS))
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        ctx = err.get("ctx") or {}
        if err["type"] == "too_short" and "min_length" in ctx:  # not "Tuple should have at least 1 item ..."
            least = ctx["min_length"]
            msg = f"needs at least {least} {'entry' if least == 1 else 'entries'}, got {ctx.get('actual_length', 0)}"
        found.append((prefix + loc, msg))
    return found


def format_validation(exc: ValidationError, prefix: str = "") -> tuple[str, str | None]:
    """The message of a ValidationError (every error, `field: message`; one error per field, so a
    field that failed does not also report its container) and the first field."""
    found = validation_messages(exc, prefix)
    kept = [(f, m) for f, m in found if not any(o != f and o.startswith(f + ".") for o, _ in found)] or found
    return "; ".join(f"{f}: {m}" if f else m for f, m in kept), (kept[0][0] or None)
