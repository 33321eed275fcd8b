"""The layout keeps its direction (docs/architecture.md, "Layout"):

    controlplane/core      the pure decision core: imports nothing of the other parts, no I/O
    controlplane/services  settings and the embedded servers: imports no other part
    controlplane/measure   torch kernel timing: imports the core only
    controlplane/store     PostgreSQL: imports the core and the services, never the policies or above
    controlplane/weights   snapshots on disk, the weight-sync queues, the broadcast path: over the store
    controlplane/api.py    the Python API for trainers and providers: over the store
    policies/              pure policies over the core (no clock, filesystem, randomness or I/O)
    policies/live/         the adapters that run the policies against the store
    agents/, cli/          reach the database only through the store (no SQL driver of their own)

Checked statically over every module (imports inside functions too), and, for the core, by importing
it in a fresh interpreter and looking at what it loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
NETWORK_AND_DB = ("sqlalchemy", "psycopg", "alembic", "celery", "kombu", "redis", "httpx", "requests", "aiohttp",
                  "urllib3", "http.client", "urllib.request", "socket", "subprocess", "torch")
OTHER_PARTS = ("pearl.controlplane.store", "pearl.controlplane.services", "pearl.controlplane.measure",
               "pearl.policies", "pearl.sim", "pearl.cli", "pearl.agents", "pearl.migrations")

# folder -> imports it must not make
RULES: dict[str, tuple[str, ...]] = {
    "controlplane": ("pearl.policies", "pearl.sim", "pearl.cli", "pearl.agents", "pearl.controlplane.measure"),
    "controlplane/core": OTHER_PARTS + NETWORK_AND_DB,
    "controlplane/services": ("pearl.controlplane.core", "pearl.controlplane.store", "pearl.controlplane.measure",
                              "pearl.policies", "pearl.sim", "pearl.cli", "pearl.agents"),
    "controlplane/measure": ("pearl.controlplane.store", "pearl.controlplane.services", "pearl.policies",
                             "pearl.sim", "pearl.cli", "pearl.agents", "sqlalchemy", "psycopg"),
    "controlplane/store": ("pearl.controlplane.measure", "pearl.policies", "pearl.sim", "pearl.cli", "pearl.agents"),
    "controlplane/weights": ("pearl.controlplane.measure", "pearl.policies", "pearl.sim", "pearl.cli", "pearl.agents"),
    "policies": ("pearl.policies.live", "pearl.controlplane.store", "pearl.controlplane.services",
                 "pearl.controlplane.measure", "pearl.sim", "pearl.cli", "pearl.agents", "pearl.migrations",
                 "pearl.controlplane.core.catalog", "pearl.controlplane.core.inventory",
                 *NETWORK_AND_DB, "os", "pathlib", "io", "time", "datetime", "random", "numpy.random"),
    "policies/live": ("pearl.sim", "pearl.cli", "pearl.agents", "psycopg"),
    "agents": ("pearl.cli", "pearl.sim.runner", "sqlalchemy", "psycopg"),
    "cli": ("sqlalchemy", "psycopg"),
}


def _package(folder: str) -> str:
    return "pearl." + folder.replace("/", ".")


def _imports(path: Path, package: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def _modules(folder: str) -> list[Path]:
    return sorted((REPO / folder).glob("*.py"))  # one folder level: sub-packages have rules of their own


CASES = [(folder, path) for folder in RULES for path in _modules(folder)]


@pytest.mark.parametrize(("folder", "path"), CASES, ids=[f"{f}/{p.name}" for f, p in CASES])
def test_each_part_imports_only_in_its_direction(folder: str, path: Path):
    banned = RULES[folder]
    found = _imports(path, _package(folder))
    bad = sorted(n for n in found for b in banned if n == b or n.startswith(b + "."))
    assert not bad, f"{folder}/{path.name} imports {bad}"


def test_every_part_has_modules_and_the_old_flat_names_are_gone():
    for folder in RULES:
        assert _modules(folder), folder
    flat = sorted(p.name for p in (REPO / "controlplane").glob("*.py"))
    assert flat == ["__init__.py", "api.py", "errors.py"], flat  # its parts, the errors and the Python API


def test_the_core_loads_no_io_module_when_imported():
    # a fresh interpreter: this test process has imported the adapters already
    core = sorted(f"pearl.controlplane.core.{p.stem}" for p in _modules("controlplane/core") if p.stem != "__init__")
    policies = sorted(f"pearl.policies.{p.stem}" for p in _modules("policies") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        f"for name in {core + policies!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert "pearl.controlplane.core.selector" in loaded  # the check sees what the core imported
    # (socket is checked statically only: pydantic's e-mail helpers load it)
    banned = OTHER_PARTS[:3] + ("pearl.policies.live", "pearl.sim") + tuple(
        m for m in NETWORK_AND_DB if m not in ("socket", "subprocess"))
    leaked = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in banned))
    assert not leaked, f"the pure core imports {leaked}"


def test_no_policy_module_opens_a_file():
    for path in _modules("policies"):
        assert "open(" not in path.read_text(), path.name
