"""`pearlctl reap`: one reaper pass (cron can run it; every agent also runs one while it leads)."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import emit_json, handle_errors, out


def register(app: typer.Typer) -> None:
    app.command("reap")(reap)


@handle_errors
def reap(
    max_attempts: Annotated[int, typer.Option("--max-attempts", min=1,
                                              help="Claims of one step that may expire before it fails.")]
    = 3,  # reaper.DEFAULT_MAX_ATTEMPTS (tests/unit/test_cli_errors.py keeps them equal)
    agent_timeout: Annotated[float, typer.Option("--agent-timeout", min=0.1,
                                                 help="Seconds without a heartbeat after which an agent is gone.")]
    = 30.0,  # reaper.DEFAULT_AGENT_TIMEOUT_S
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Rescue expired step claims, fail the plan of a failed step (its cleanup plan frees the GPUs of an
    abandoned expansion group), finish a plan with nothing left, and mark silent agents and their
    workers. Idempotent: safe from cron at any rate, beside the agents."""
    from pearl.controlplane.store import reaper
    from pearl.controlplane.store.db import make_engine, require_schema

    engine = make_engine(component="policy")
    try:
        require_schema(engine)
        report = reaper.reap(engine, max_attempts=max_attempts, agent_timeout_s=agent_timeout,
                             actor="pearlctl reap")
    finally:
        engine.dispose()
    if as_json:
        emit_json(report.to_dict())
        return
    if report.empty:
        out.print("nothing to reap")
        return
    parts = []
    if report.rescued:
        parts.append(f"rescued {len(report.rescued)} step(s): "
                     + ", ".join(f"{step} -> {status}" for step, status in report.rescued))
    for plan, cleanup in report.failed_plans:
        parts.append(f"plan {plan} failed" + (f"; cleanup plan {cleanup} applies" if cleanup else ""))
    if report.finished_plans:
        parts.append(f"plan(s) {', '.join(map(str, report.finished_plans))} succeeded")
    if report.silent_agents:
        parts.append(f"silent agent(s) {', '.join(map(str, report.silent_agents))} marked stopped")
    if report.revoked_gpus:
        parts.append(f"revoked GPU(s) {', '.join(map(str, report.revoked_gpus))} (their notice ran out)")
    if report.training_started is not None:
        parts.append(f"training step {report.training_started} started (its GPUs are back)")
    if report.unreachable_workers:
        parts.append(f"worker(s) {', '.join(map(str, report.unreachable_workers))} unreachable (no live agent)")
    out.print("; ".join(parts), highlight=False)
