"""The policies are pure functions the live loop can call as they are: nothing in policies/ imports the
simulator, the command line, the agents, a database or network client, or the clock, the filesystem
or a random source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

POLICIES = Path(__file__).resolve().parents[2] / "policies"
FORBIDDEN = ("pearl.sim", "pearl.cli", "pearl.agents", "pearl.migrations",
             *(f"pearl.controlplane.{m}" for m in ("db", "embedded", "settings", "schema", "queries", "state",
                                                  "status", "planning", "plans", "profiles", "telemetry_ingest",
                                                  "kernels", "catalog", "inventory")),
             "sqlalchemy", "psycopg", "redis", "celery", "requests", "httpx", "socket", "subprocess",
             "os", "pathlib", "io", "time", "datetime", "random", "numpy.random")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ("pearl.policies." if node.level else "") + (node.module or "")
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.py")), ids=lambda p: p.name)
def test_a_policy_module_imports_nothing_impure(path):
    bad = {n for n in _imports(path) for f in FORBIDDEN if n == f or n.startswith(f + ".")}
    assert not bad, f"{path.name} imports {sorted(bad)}"
    assert "open(" not in path.read_text()
