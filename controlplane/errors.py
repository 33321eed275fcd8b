"""pearl's exceptions. The docstring of each is its default message; the CLI maps them to exit codes."""

from __future__ import annotations


class PearlError(Exception):
    """pearl failed."""

    exit_code = 1

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
        self.field = field  # the input field or option at fault, when one is (`--json` errors name it)


class BadInput(PearlError):
    """Bad input."""

    exit_code = 2


class DatabaseUnavailable(PearlError):
    """The database does not answer."""


class DatabaseBusy(DatabaseUnavailable):
    """The database cancelled or aborted the statement (a timeout, a deadlock, a serialization failure, a
    lock not available): nothing it did was kept, and it can be tried again."""


class NodeTaken(PearlError):
    """Another agent runs this node."""


class StalePlan(PearlError):
    """The plan was computed against a state that has moved on."""


class IllegalTransition(PearlError):
    """The transition is not allowed."""


class StepFailed(PearlError):
    """A plan step failed."""


class ClaimLost(PearlError):
    """The step is no longer running under that fence: the claim expired or another agent took it."""


class NotPermitted(PearlError):
    """The database role this process connects as may not do that (SQLSTATE 42501)."""
