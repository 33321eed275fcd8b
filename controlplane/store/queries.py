"""The named queries of `sql/queries.sql` (and of `sql/checks.sql`), loaded by name (`query("claim_steps")`)."""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

from sqlalchemy import TextClause, text

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def load_queries(file: str = "queries.sql") -> dict[str, str]:
    """Every named query of `sql/<file>`: name -> SQL (its comment lines included)."""
    source = files("pearl.controlplane.store").joinpath(f"sql/{file}").read_text()
    marks = list(_NAME.finditer(source))
    queries = {}
    for mark, following in zip(marks, [*marks[1:], None], strict=True):
        body = source[mark.end() : following.start() if following else len(source)]
        queries[mark.group(1)] = body.strip().rstrip(";")
    return queries


def query(name: str) -> TextClause:
    try:
        return text(load_queries()[name])
    except KeyError:
        raise KeyError(f"no query named {name!r} in queries.sql (known: {', '.join(sorted(load_queries()))})") from None
