"""`pearlctl plan` and `pearlctl apply` against a real database, in process (the `pearlctl` fixture),
`apply --wait` in a process of its own: the paper cluster with a workload block, --explain, --json,
--dry-run, stale plans, and --wait while the test plays the agents."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pearl.controlplane.core.domain import GPUState, StepStatus
from pearl.controlplane.store import step_effects
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import GPU
from pearl.controlplane.store.transitions import set_gpu_states
from plan_support import (
    PAPER_INVENTORY,
    PEARLCTL,
    REPO,
    claim_ready,
    paper_inventory,
    pin_clock,
    report,
    run_plan,
    write_inventory,
)
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.pool import NullPool

pytestmark = pytest.mark.integration



@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = create_engine(database_url, poolclass=NullPool)
    yield engine
    engine.dispose()


@pytest.fixture
def paper(pearlctl: Callable, tmp_path: Path) -> Path:
    """The paper's 32-GPU inventory with the paper scenario's workload block, imported."""
    path = write_inventory(tmp_path / "paper-with-workload.yaml", paper_inventory())
    imported = pearlctl("cluster", "import", str(path))
    assert imported.returncode == 0, imported.stderr
    return path


def plans_written(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM plans")).scalar()


def test_plan_explain_ranks_the_candidates_on_the_paper_cluster(pearlctl: Callable, paper: Path,
                                                                engine: Engine) -> None:
    shown = pearlctl("plan", "--explain", extra_env={"COLUMNS": "160"})
    assert shown.returncode == 0, shown.stderr
    text_out = shown.stdout
    # 2 dedicated workers (roll-0) plus 8 borrowable overlap workers: colocated x10 and every split of 10
    assert "budget: 2 dedicated worker(s) available, 8 overlap worker(s) borrowable" in text_out
    assert "ranked candidates for 10 worker(s)" in text_out
    ranking = [line.split()[1] for line in text_out.splitlines() if line[:5].strip().rstrip("*=").isdigit()]
    assert set(ranking) >= {"colocated", "1P9D", "2P8D", "5P5D", "9P1D"}
    assert "borrowing: gate: borrow: (R/B) x (T_ded - T_full)" in text_out
    assert "decision: nothing running: start" in text_out
    assert "catalog profile (qwen3-8b, h800, tp 2, catalog; computed)" in text_out
    assert "apply it with `pearlctl apply 1`" in text_out
    assert plans_written(engine) == 1


def test_plan_json_is_one_object_with_the_decision_and_the_plan(pearlctl: Callable, paper: Path) -> None:
    done = pearlctl("plan", "--json", "--explain")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert {"state_version", "decision", "selection", "gate", "profile", "signals", "plan", "dry_run",
            "explain"} <= set(out)
    assert out["decision"]["id"] == 1 and out["decision"]["policy"] == "pearl"
    assert out["decision"]["target"]["members"] == list(range(1, 11))
    assert len(out["selection"]["candidates"]) == 10 and out["selection"]["chosen"]
    plan = out["plan"]
    assert plan["id"] == 1 and plan["status"] == "proposed" and plan["base_version"] == out["state_version"] == 48
    assert plan["d_worker"] == 10 and len(plan["steps"]) == len({s["key"] for s in plan["steps"]})
    assert {s["status"] for s in plan["steps"]} == {"blocked"}


def test_dry_run_writes_nothing(pearlctl: Callable, paper: Path, engine: Engine) -> None:
    done = pearlctl("plan", "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["dry_run"] is True and out["decision"]["id"] is None
    assert out["plan"]["id"] is None and out["plan"]["status"] == "dry-run" and out["plan"]["steps"]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT (SELECT count(*) FROM plans) + (SELECT count(*) FROM decisions) + "
                                 "(SELECT count(*) FROM policy_memory)")).scalar() == 0


def test_plan_refuses_an_inventory_without_a_workload_block(pearlctl: Callable, database_url: str) -> None:
    assert pearlctl("plan").returncode == 1  # nothing imported yet
    assert pearlctl("cluster", "import", str(PAPER_INVENTORY)).returncode == 0
    refused = pearlctl("plan", "--explain")
    assert refused.returncode == 2
    assert "workload: the inventory has no `workload` block" in refused.stderr


def test_apply_refuses_a_stale_plan_and_a_superseded_one(pearlctl: Callable, paper: Path, engine: Engine) -> None:
    assert pearlctl("plan").returncode == 0
    assert pearlctl("plan").returncode == 0
    superseded = pearlctl("apply", "1")
    assert superseded.returncode == 1 and "plan 1 was superseded by plan 2" in superseded.stderr
    with transaction(engine, actor="provider") as session:  # the provider grants spot-0 meanwhile
        spot = session.scalars(select(GPU.id).where(GPU.zone == "preemptible")).all()
        set_gpu_states(session, spot, [GPUState.UNAVAILABLE], GPUState.FREE)
    stale = pearlctl("apply", "--latest")
    assert stale.returncode == 1
    assert "plan 2 was computed at state_version 48, the fleet is at 60; run `pearlctl plan` again" in stale.stderr
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM plan_steps WHERE status <> 'blocked'")).scalar() == 0
    assert pearlctl("apply").returncode == 2  # neither a plan id nor --latest
    assert pearlctl("apply", "7", "--latest").returncode == 2
    assert pearlctl("apply", "99").returncode == 2
    assert pearlctl("apply", "--latest").returncode == 1  # nothing proposed any more


def _apply_and_wait(pearlctl_env: dict[str, str], database_url: str, plan_id: int) -> subprocess.Popen[str]:
    env = {**pearlctl_env, "PEARL_DATABASE_URL": database_url}
    return subprocess.Popen([str(PEARLCTL), "apply", str(plan_id), "--wait", "--json", "--poll", "0.1",
                             "--timeout", "60"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _until_claimed(engine: Engine, clock) -> list[dict]:
    for _ in range(200):
        claimed = claim_ready(engine, clock())
        if claimed:
            return claimed
        time.sleep(0.05)
    raise AssertionError("apply never made a step ready")


def test_apply_wait_returns_when_the_agents_finish(pearlctl: Callable, pearlctl_env: dict[str, str],
                                                   database_url: str, paper: Path, engine: Engine, clock) -> None:
    assert pearlctl("plan").returncode == 0
    waiting = _apply_and_wait(pearlctl_env, database_url, 1)
    for step in _until_claimed(engine, clock):  # the test plays the agents
        report(engine, step, StepStatus.SUCCEEDED, clock())
    run_plan(engine, clock())
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    result = json.loads(out)
    assert result["plan"]["status"] == "succeeded" and len(result["ready"]) == 10
    assert {s["status"] for s in result["plan"]["steps"]} == {"succeeded"}
    assert "plan 1: applying" in err  # progress on stderr, one JSON object on stdout


def test_apply_wait_exits_1_when_a_step_fails(pearlctl: Callable, pearlctl_env: dict[str, str],
                                              database_url: str, paper: Path, engine: Engine, clock) -> None:
    assert pearlctl("plan").returncode == 0
    waiting = _apply_and_wait(pearlctl_env, database_url, 1)
    claimed = _until_claimed(engine, clock)
    report(engine, claimed[0], StepStatus.FAILED, clock(), error="cuda out of memory")
    for step in claimed[1:]:  # the others' successes are refused (the plan failed): their agents stop them
        assert report(engine, step, StepStatus.SUCCEEDED, clock(), stop_when_plan_stops=True).status == "failed"
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 1
    assert json.loads(out)["plan"]["status"] == "failed"
    assert f"plan 1 failed: step {claimed[0]['key']}" in err and "cuda out of memory" in err


def test_apply_abort_gives_up_an_applying_plan(pearlctl: Callable, paper: Path, engine: Engine, clock) -> None:
    assert pearlctl("plan").returncode == 0
    assert pearlctl("apply", "1").returncode == 0
    claimed = claim_ready(engine, clock())  # the agents took the first steps (and their GPUs), then went silent
    for step in claimed:
        with transaction(engine) as session:
            step_effects.begin(session, step_effects.claimed_step(session, step["id"], step["fence"]))
    aborted = pearlctl("apply", "--abort", "1", "--json")
    assert aborted.returncode == 0, aborted.stderr
    out = json.loads(aborted.stdout)
    assert out["plan"]["status"] == "failed" and out["plan"]["error"] == "aborted by pearlctl apply --abort"
    assert out["cancelled"] and sorted(out["release"]) == sorted(s["worker_id"] for s in claimed)
    assert {s["status"] for s in out["plan"]["steps"]} == {"running", "cancelled"}
    assert out["cleanup"] == 2  # applied at once: it releases what the aborted plan's starts took
    with transaction(engine) as session:  # the silent agents' claims expire; the cleanup runs
        pin_clock(session, clock.advance(60))
        session.execute(query("rescue_expired_steps"), {"max_attempts": 3})
    run_plan(engine, clock())
    again = pearlctl("apply", "--abort", "1")
    assert again.returncode == 1 and "plan 1 is failed; only an applying plan can be aborted" in again.stderr
    both = pearlctl("apply", "1", "--abort", "1")
    assert both.returncode == 2 and "--abort: give the plan to abort alone" in both.stderr
    assert pearlctl("plan").returncode == 0  # a new plan applies: nothing is left applying
    applied = pearlctl("apply", "--latest")
    assert applied.returncode == 0, applied.stderr
