"""What every command shares: error mapping to exit codes, JSON output, the stderr console.

Exit codes (docs/formats.md): 0 success, 2 bad input (arguments, files, events), 1 other failures.
`--json` prints one JSON object on stdout and nothing else there; progress and logs go to stderr. A
command that fails under `--json` prints one too: {"error": message, "field": the field or option at
fault (null when none), "exit": the exit code}.

Both consoles print text as it is (no Rich markup): messages carry file names, package extras and
node names with brackets in them (`inv[prod].yaml`, `.[torch]`). Markup is opted into per call.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from pearl.controlplane.errors import PearlError
from rich.console import Console
from rich.text import Text

# Lines of text are not wrapped (a message piped to a file stays one line); tables fit the width.
out = Console(markup=False, soft_wrap=True)  # tables for people, on stdout
err = Console(stderr=True, markup=False, soft_wrap=True)  # progress, logs and errors

F = TypeVar("F", bound=Callable[..., Any])
MAX_ID = 2**63 - 1  # ids, steps and versions are PostgreSQL bigints: a larger number is bad input

_JSON_PARAMS = ("as_json", "json_")
# "nodes.2.zone: ...", "--set workload.batch_size: ...", "PEARL_HOME: ...": the field a message leads with
_LEADING_FIELD = re.compile(r"^(--?[\w-]+(?: [\w.\[\]-]+)?|[A-Za-z_][\w.\[\]-]*): ")


def field_of(exc: BaseException) -> str | None:
    """The field or option an error is about: its `field`, else the name its message leads with."""
    field = getattr(exc, "field", None)
    if field:
        return str(field)
    match = _LEADING_FIELD.match(str(exc))
    return match.group(1) if match else None


def fail(message: str, exit_code: int, as_json: bool, field: str | None = None) -> typer.Exit:
    """Report a failure (a JSON object on stdout under `--json`, a line on stderr always) and return
    the typer.Exit to raise."""
    if as_json:
        emit_json({"error": message, "field": field, "exit": exit_code})
    err.print(Text.assemble(("error:", "red"), " ", message), highlight=False, soft_wrap=True)
    return typer.Exit(exit_code)


def is_usage_error(exc: BaseException) -> bool:
    """Click's (Typer's) exceptions for bad arguments, without importing click for it."""
    return hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int)


def usage_field(exc: BaseException) -> str | None:
    """The option or argument a usage error is about."""
    hint = getattr(exc, "param_hint", None)
    if isinstance(hint, str):
        return hint.strip("'\"")
    param = getattr(exc, "param", None)
    opts = getattr(param, "opts", None)
    if opts:
        return opts[0]
    return getattr(exc, "option_name", None) or getattr(param, "name", None)


def _unexpected(exc: BaseException) -> tuple[str, int, str | None] | None:
    """Errors that are not pearl's but still have a plain meaning for the user (no traceback)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({exc.reason} at byte {exc.start})", 2, None
    if isinstance(exc, MemoryError):
        return "out of memory: the input asks for more than this machine holds; use smaller sizes", 2, None
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or exc}{where}", 1, None
    return None


def _option_with_nul(kwargs: dict[str, Any]) -> str | None:
    """The option given text with a NUL character in it (PostgreSQL text cannot hold one), if any."""
    for name, value in kwargs.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, str) and "\x00" in v for v in values):
            return "--" + name.rstrip("_").replace("_", "-")
    return None


def handle_errors(fn: F) -> F:
    """Turn pearl's errors into a one-line message on stderr (and a JSON object on stdout under
    `--json`) with the right exit code; never a traceback for bad input."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = any(bool(kwargs.get(name)) for name in _JSON_PARAMS)
        nul = _option_with_nul(kwargs)
        if nul:
            raise fail(f"{nul}: text may not contain a NUL (0x00) character", 2, as_json, nul)
        try:
            return fn(*args, **kwargs)
        except PearlError as exc:
            raise fail(str(exc), exc.exit_code, as_json, field_of(exc)) from None
        except Exception as exc:
            if not (as_json and is_usage_error(exc)):  # typer.BadParameter raised inside a command
                raise
            raise fail(exc.format_message(), exc.exit_code, True, usage_field(exc)) from None
        except (OSError, UnicodeDecodeError, MemoryError) as exc:
            known = _unexpected(exc)
            assert known is not None
            raise fail(known[0], known[1], as_json, known[2]) from None

    return wrapper  # type: ignore[return-value]


def emit_json(obj: Any) -> None:
    """The one JSON object a `--json` command prints."""
    sys.stdout.write(json.dumps(obj, default=str, sort_keys=False) + "\n")
    sys.stdout.flush()


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 node`, `2 nodes`."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


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
