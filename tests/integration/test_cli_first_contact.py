"""The command line as a new user meets it, in process against a real database: README's walkthrough
with the shipped files, messages in words, `plan` and `apply` while a plan applies, and `status` in
a small terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml
from pearl.cli.app import app
from plan_support import REPO
from rich.console import Console
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

SWE = REPO / "sim" / "inventories" / "paper-32-h800-swe.yaml"
TELEMETRY = REPO / "sim" / "telemetry" / "paper-swe-step-0.json"


@pytest.fixture
def cli(database_url: str, tmp_path: Path):
    env = {"PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(tmp_path / "home"), "PEARL_BROKER_URL": ""}

    def invoke(*args: str):
        return CliRunner().invoke(app, list(args), env=env)

    return invoke


def plans(database_url: str) -> list[tuple[int, str]]:
    engine = create_engine(database_url, poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, status::text FROM plans ORDER BY id")).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def test_the_readme_walkthrough_completes_with_the_shipped_files(cli) -> None:
    assert cli("init").exit_code == 0
    imported = cli("cluster", "import", str(SWE))
    assert imported.exit_code == 0, imported.output
    assert "created 5 nodes, 32 GPUs, 16 worker slots" in imported.stdout
    assert cli("status").exit_code == 0
    explained = cli("plan", "--explain")
    assert explained.exit_code == 0, explained.output
    assert "apply it with `pearlctl apply 1`" in explained.stdout
    ingested = cli("event", "telemetry", str(TELEMETRY), "--json")
    assert ingested.exit_code == 0, ingested.output
    assert json.loads(ingested.stdout)["outcome"] == "ingested"
    replanned = cli("plan", "--json")
    assert replanned.exit_code == 0, replanned.output
    assert json.loads(replanned.stdout)["profile"]["provenance"] == "fitted"


def test_counts_are_words_not_python(cli, tmp_path: Path) -> None:
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"model": "qwen3-8b", "gpu": "h800", "tp": 2,
                                   "nodes": [{"name": "roll-0", "zone": "rollout", "gpus": 2, "address": "h"}]}))
    res = cli("cluster", "import", str(one))
    assert res.exit_code == 0 and "created 1 node, 2 GPUs, 1 worker slot " in res.stdout


def test_while_a_plan_applies_plan_says_so_and_apply_suggests_what_works(cli, database_url: str) -> None:
    from pearl.controlplane.store.db import make_engine
    from pearl.policies.live.policy_pass import plan as policy_plan

    for args in (("cluster", "import", str(SWE)), ("plan",), ("apply", "1")):  # no agents here: 1 stays applying
        res = cli(*args)
        assert res.exit_code == 0, (args, res.output)
    refused = cli("plan")
    assert refused.exit_code == 1, refused.output
    assert "plan 1 is still applying" in refused.stderr and "nothing was written" in refused.stderr, refused.stderr
    as_json = cli("plan", "--json")
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["exit"] == 1, as_json.output
    assert plans(database_url) == [(1, "applying")]
    dry = cli("plan", "--dry-run")
    assert dry.exit_code == 0, dry.output  # what would be decided, writing nothing

    engine = make_engine(database_url)  # a plan written meanwhile by another writer
    try:
        second = policy_plan(engine).plan_id
    finally:
        engine.dispose()
    blocked = cli("apply", str(second))
    assert blocked.exit_code == 1, blocked.output
    assert "--wait" not in blocked.stderr
    assert "pearlctl apply --abort 1" in blocked.stderr and "pearlctl status --watch" in blocked.stderr, blocked.stderr
    aborted = cli("apply", "--abort", "1")
    assert aborted.exit_code == 0, aborted.output  # the suggestion works
    assert dict(plans(database_url))[1] == "failed"


def test_status_and_plan_fit_80_columns_and_the_plan_line_stays_in_24_rows(cli, database_url: str) -> None:
    from pearl.cli.plan import render as render_plan
    from pearl.cli.status import render
    from pearl.controlplane.store.db import make_engine
    from pearl.controlplane.store.fleet_status import read_fleet_status
    from pearl.policies.live.policy_pass import plan as policy_plan

    assert cli("cluster", "import", str(SWE)).exit_code == 0
    assert cli("plan").exit_code == 0
    assert cli("apply", "1").exit_code == 0
    engine = make_engine(database_url)
    try:
        s = read_fleet_status(engine)
        planned = policy_plan(engine, dry_run=True)
    finally:
        engine.dispose()
    screen = io.StringIO()  # the plan table folds its cells in 80 columns, never cuts one short
    Console(file=screen, width=80, color_system=None).print(render_plan(planned))
    assert max(len(line) for line in screen.getvalue().splitlines()) <= 80 and "…" not in screen.getvalue()
    assert "role=coloc" in screen.getvalue() and "w1.start" in screen.getvalue()
    screen = io.StringIO()
    Console(file=screen, width=80, color_system=None).print(render(s, width=80))
    lines = screen.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in screen.getvalue()  # no cell cut short
    assert lines[1].startswith("latest plan: #1 applying")
    words = " ".join(screen.getvalue().split())
    assert "steps: 23 ready" in words or "blocked" in words
    assert "{" not in words
    assert all(f" {w['node']} " in screen.getvalue() for w in s["workers"])
    for column in ("id", "node", "role", "activity", "gpu state"):
        assert f" {column} " in screen.getvalue()
    # --watch in a 24-row terminal: the summary and the plan line first, the workers that fit after
    screen = io.StringIO()
    Console(file=screen, width=80, height=24, color_system=None).print(render(s, width=80, max_workers=5))
    watched = screen.getvalue().splitlines()
    assert watched[1].startswith("latest plan") and "first 5 of 16" in screen.getvalue()
