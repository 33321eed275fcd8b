"""The decision core is pure (design.md): importing it loads no database, HTTP, broker or torch
module, nor pearl's own database adapters, so the simulator and the live policy run the same code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CORE = (
    "pearl.controlplane.catalog",
    "pearl.controlplane.perfmodel",
    "pearl.controlplane.profile",
    "pearl.controlplane.predictor",
    "pearl.controlplane.selector",
    "pearl.controlplane.orchestrator",
    "pearl.controlplane.tracker",
    "pearl.policies.switching",
    "pearl.policies.borrowing",
    "pearl.policies.pearl",
)
FORBIDDEN = (
    "sqlalchemy", "psycopg", "alembic", "torch", "celery", "kombu", "redis", "httpx", "requests", "aiohttp",
    "urllib3", "http.client", "urllib.request",
    "pearl.controlplane.db", "pearl.controlplane.schema", "pearl.controlplane.profiles",
    "pearl.controlplane.planning", "pearl.controlplane.telemetry_ingest", "pearl.controlplane.embedded",
)  # fmt: skip


def test_the_decision_core_imports_no_io():
    # a fresh interpreter: this test process has imported the adapters already
    code = (
        "import importlib, json, sys\n"
        f"for name in {CORE!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert "pearl.controlplane.selector" in loaded  # the check sees what the core imported
    leaked = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert not leaked, f"the pure core imports {leaked}"
