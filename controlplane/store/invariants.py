"""The invariant checker behind `pearlctl check`: the checks of `sql/checks.sql` over the tables and the
audit log, in one consistent view.

Each check is a read-only query returning one row per violation (entity, entity_id, detail) under the
number of the invariant it holds (docs/state-machine.md; 5 is the audit log). The database refuses
most of these as they happen; the checker finds what got past it (a trigger disabled, a constraint
dropped, a superuser's write) and what only the history shows (a step that succeeded twice, a fence
that went down, a loan open while training ran).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import load_queries
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from .transitions import state_version

_INVARIANT = re.compile(r"^--\s*invariant:\s*(\d+)\s*$", re.MULTILINE)
CHECKS_FILE = "checks.sql"


@dataclass(frozen=True)
class Violation:
    check: str
    invariant: int
    entity: str
    entity_id: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "invariant": self.invariant, "entity": self.entity,
                "entity_id": self.entity_id, "detail": self.detail}


@dataclass(frozen=True)
class Report:
    state_version: int
    checks: dict[str, int]  # check -> its invariant
    violations: tuple[Violation, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        found: dict[str, int] = {}
        for v in self.violations:
            found[v.check] = found.get(v.check, 0) + 1
        return {
            "ok": self.ok,
            "state_version": self.state_version,
            "violations": [v.to_dict() for v in self.violations],
            "checks": [{"check": name, "invariant": inv, "violations": found.get(name, 0)}
                       for name, inv in self.checks.items()],
        }


def checks() -> dict[str, tuple[int, str]]:
    """Every check of checks.sql: name -> (invariant, SQL)."""
    out = {}
    for name, sql in load_queries(CHECKS_FILE).items():
        mark = _INVARIANT.search(sql)
        if mark is None:
            raise ValueError(f"{CHECKS_FILE}: check {name} names no invariant")
        out[name] = (int(mark.group(1)), sql)
    return out


def check(engine: Engine) -> Report:
    """Run every check in one read-only REPEATABLE READ transaction (one snapshot of the rows and the log)."""
    with transaction(engine, isolation_level="REPEATABLE READ") as session:
        session.execute(text("SET TRANSACTION READ ONLY"))
        return inspect(session)


def inspect(session: Session) -> Report:
    """Every check, in the caller's transaction."""
    found: list[Violation] = []
    defined = checks()
    version = state_version(session)
    for name, (invariant, sql) in defined.items():
        for row in session.execute(text(sql)).mappings():
            found.append(Violation(name, invariant, row["entity"], str(row["entity_id"]), row["detail"]))
    return Report(int(version), {name: inv for name, (inv, _) in defined.items()}, tuple(found))
