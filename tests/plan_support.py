"""Helpers shared by the tests: paths (the repository, `pearlctl`), inventories (with or without a
workload block), synthetic telemetry, proposing a plan, an agent's claim-and-report loop, and
running functions at once in threads."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pearl.controlplane.core.domain import Role, StepAction, StepStatus
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.core.inventory import parse_inventory
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.store import plan_store, step_effects
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.inventory_import import import_inventory
from pearl.controlplane.store.plan_store import (
    DecisionRecord,
    PlanProgress,
    complete_step,
    finish_step,
    target_to_dict,
    write_decision,
    write_plan,
)
from pearl.controlplane.store.snapshot import load_snapshot
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parent.parent
PEARLCTL = Path(sys.executable).with_name("pearlctl")
PAPER_INVENTORY = REPO / "sim" / "inventories" / "paper-32-h800.yaml"
PAPER_SCENARIO = REPO / "sim" / "scenarios" / "paper-qwen3-8b-seg2.yaml"


def paper_workload() -> dict[str, Any]:
    return yaml.safe_load(PAPER_SCENARIO.read_text())["workload"]


def paper_inventory(workload: bool = True) -> dict[str, Any]:
    """The paper's 32-GPU cluster, with the paper scenario's workload block."""
    raw = yaml.safe_load(PAPER_INVENTORY.read_text())
    if workload:
        raw["workload"] = paper_workload()
    return raw


def small_inventory(workload: bool = True) -> dict[str, Any]:
    """2 overlap slots on train-0 (workers 1, 2), 1 dedicated slot on roll-0 (3), 1 on spot-0 (4, not
    granted); tp 2."""
    raw = {
        "model": "qwen3-8b", "gpu": "h800", "tp": 2,
        "nodes": [
            {"name": "train-0", "zone": "training", "gpus": 4, "address": "127.0.0.1"},
            {"name": "roll-0", "zone": "rollout", "gpus": 2, "address": "127.0.0.1"},
            {"name": "spot-0", "zone": "preemptible", "gpus": 2, "address": "127.0.0.1"},
        ],
    }
    if workload:
        raw["workload"] = paper_workload()
    return raw


def import_cluster(engine: Engine, raw: dict[str, Any]) -> None:
    with transaction(engine, actor="test") as session:
        import_inventory(session, parse_inventory(raw))


def write_inventory(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def telemetry(step: int, batch_size: int = 64, seed: int = 0, iterations: bool = False) -> dict[str, Any]:
    """One rollout step drawn from the paper workload (docs/formats.md)."""
    w = Workload.model_validate(paper_workload())
    rng = np.random.default_rng(seed + 1000 * step)
    trajectories = []
    for _ in range(batch_size):
        turns = int(max(1, min(30, round(float(w.turns.sample(rng, 1)[0])))))
        trajectories.append({
            "turns": turns,
            "prompt_tokens": int(w.prompt_tokens.sample(rng, 1)[0]),
            "obs_tokens": [int(x) for x in w.obs_tokens_per_turn.sample(rng, turns - 1)],
            "gen_tokens": [int(x) for x in w.gen_tokens_per_turn.sample(rng, turns)],
            "env_s": [round(float(x), 3) for x in w.env_latency_s.sample(rng, turns - 1)],
            "truncated": False,
        })
    body: dict[str, Any] = {"step": step, "batch_size": batch_size, "trajectories": trajectories,
                            "decode_fraction": 0.6}
    if iterations:
        body["iterations"] = [
            {"worker": 1, "role": "colocated", "batch": b, "context_tokens_mean": 8000.0, "prefill_tokens": 0,
             "seconds": 0.012 + 0.0001 * b}
            for b in (4, 4, 4, 8, 8, 8)
        ]
    return body


def node_id(engine: Engine, name: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT id FROM nodes WHERE name = :n"), {"n": name}).scalar_one()


def pin_clock(session: Session, now: datetime) -> None:
    """The database's clock (`pearl_now()`) reads `now` for the rest of this transaction."""
    session.execute(text("SELECT set_config('pearl.now', :t, true)"), {"t": now.isoformat()})


def claim_ready(engine: Engine, now: datetime, agent: int | None = None) -> list[dict[str, Any]]:
    """Claim every ready step of every node, as the nodes' agents would (one per worker at a time)."""
    claimed: list[dict[str, Any]] = []
    with transaction(engine) as session:
        pin_clock(session, now)
        nodes = session.execute(text("SELECT id FROM nodes ORDER BY id")).scalars().all()
        for n in nodes:
            rows = plan_store.claim_steps(session, n, agent, lease_s=30, limit=100)
            claimed.extend(dict(r) for r in rows)
    return claimed


def enact(session: Session, step: dict[str, Any]) -> PlanProgress:
    """What an agent with no servers does for a claimed step: write its effect, then report it
    succeeded, in the session's transaction (a start's endpoint is made up; a load reaches the
    trainer's version)."""
    claimed = step_effects.claimed_step(session, step["id"], step["fence"])
    step_effects.begin(session, claimed)
    effect: dict[str, Any] = {}
    if claimed.action is StepAction.START:
        effect["endpoint"] = f"http://127.0.0.1:1/w{claimed.worker_id}"
    elif claimed.action is StepAction.LOAD_WEIGHTS:
        effect["weights_version"] = step_effects.trainer_version(session)
    return complete_step(session, step["id"], step["fence"], **effect)


def report(engine: Engine, step: dict[str, Any], status: StepStatus, now: datetime,
           error: str | None = None, stop_when_plan_stops: bool = False) -> PlanProgress:
    """The agent's report of a claimed step: a success with its effect (`enact`), or a failure. With
    `stop_when_plan_stops`, a success refused because the plan stopped is reported cancelled, as an
    agent does."""
    try:
        with transaction(engine, actor="test agent") as session:
            pin_clock(session, now)
            if status is StepStatus.SUCCEEDED:
                return enact(session, step)
            return finish_step(session, step["id"], step["fence"], status, error=error)
    except step_effects.PlanStopped:
        if not stop_when_plan_stops:
            raise
    with transaction(engine, actor="test agent") as session:  # the plan failed meanwhile: stop the step
        pin_clock(session, now)
        return finish_step(session, step["id"], step["fence"], StepStatus.CANCELLED, error="its plan stopped")


def run_plan(engine: Engine, now: datetime, fail: str | None = None, limit: int = 100) -> list[PlanProgress]:
    """Claim and enact every step until nothing is ready; the step keyed `fail` fails."""
    progress: list[PlanProgress] = []
    for _ in range(limit):
        claimed = claim_ready(engine, now)
        if not claimed:
            return progress
        for step in claimed:
            failed = step["key"] == fail
            progress.append(report(engine, step, StepStatus.FAILED if failed else StepStatus.SUCCEEDED, now,
                                   "boom" if failed else None, stop_when_plan_stops=True))
    raise AssertionError("the plan never settled")


# -- plans -------------------------------------------------------------------------------------------

COLOCATED_3 = Target(frozenset({1, 2, 3}), {Role.COLOCATED: 3}, reason="test: three colocated")


def propose(engine: Engine, target: Target = COLOCATED_3) -> int:
    """Orchestrate `target` against the current fleet and store it, with its decision, as a proposed plan."""
    with transaction(engine, actor="test") as session:
        snapshot = load_snapshot(session)
        plan = orchestrate(snapshot, target)
        decision = write_decision(session, DecisionRecord(
            policy="test", state_version=snapshot.state_version, reason=target.reason,
            target=target_to_dict(target), inputs={"note": "test", "inf": float("inf")}))
        plan_id = write_plan(session, plan, decision)
    assert plan_id is not None
    return plan_id


# -- concurrency -------------------------------------------------------------------------------------


def in_threads(*fns: Callable[[], object]) -> list[object]:
    """Run the functions at once (released together by a barrier); each result or raised exception."""
    barrier = threading.Barrier(len(fns))
    results: list[object] = [None] * len(fns)

    def call(i: int, fn: Callable[[], object]) -> None:
        barrier.wait()
        try:
            results[i] = fn()
        except Exception as exc:  # returned to the caller, which asserts on it
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results
