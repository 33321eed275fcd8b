"""What every command shares: error mapping to exit codes, JSON output, the stderr console.

Exit codes (docs/formats.md): 0 success, 2 bad input (arguments, files, events), 1 other failures.
`--json` prints one JSON object on stdout and nothing else there; progress and logs go to stderr.
"""

from __future__ import annotations

import functools
import json
import logging
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


class _JsonLines(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's `action` and extras."""

    _STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname.lower(),
                "logger": record.name, "message": record.getMessage()}
        line.update({k: v for k, v in record.__dict__.items() if k not in self._STANDARD})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(json_lines: bool = False, level: int = logging.INFO) -> None:
    """Logs of a long-running process (agent, worker, loop, router) on stderr: plain lines, or JSON."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines() if json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("pearl")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
