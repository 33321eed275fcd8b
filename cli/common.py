"""What every command shares: error mapping to exit codes, JSON output, the stderr console.

Exit codes (docs/formats.md): 0 success, 2 bad input (arguments, files, events), 1 other failures.
`--json` prints one JSON object on stdout and nothing else there; progress and logs go to stderr.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from pearl.controlplane.errors import PearlError
from rich.console import Console

out = Console()  # tables for people, on stdout
err = Console(stderr=True)  # progress, logs and errors

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn pearl's errors into a one-line message on stderr and the right exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PearlError as exc:
            err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper  # type: ignore[return-value]


def emit_json(obj: Any) -> None:
    """The one JSON object a `--json` command prints."""
    sys.stdout.write(json.dumps(obj, default=str, sort_keys=False) + "\n")
    sys.stdout.flush()
