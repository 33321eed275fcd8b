"""`pearlctl apply [PLAN_ID | --latest] [--wait] [--json]`: enact a proposed plan (refused if stale);
`pearlctl apply --abort PLAN_ID`: give up an applying plan that cannot finish."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from pearl.controlplane.errors import BadInput, StepFailed

from .common import MAX_ID, emit_json, err, fail, handle_errors, out


def register(app: typer.Typer) -> None:
    app.command("apply")(apply_command)


def _step_counts(summary: dict[str, Any]) -> str:
    from pearl.controlplane.store.plan_store import step_counts

    return ", ".join(f"{n} {status}" for status, n in sorted(step_counts(summary).items()))


@handle_errors
def apply_command(
    plan_id: Annotated[int | None, typer.Argument(help="The plan to apply.", min=1, max=MAX_ID)] = None,
    latest: Annotated[bool, typer.Option("--latest", help="Apply the latest proposed plan.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the plan succeeds or fails.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.0, help="Seconds --wait waits at most.")] = 600.0,
    poll: Annotated[float, typer.Option("--poll", min=0.05, help="Seconds between polls while waiting.")] = 0.5,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    abort_id: Annotated[int | None, typer.Option(
        "--abort", metavar="PLAN_ID", min=1, max=MAX_ID,
        help="Give up an applying plan that cannot finish: mark it failed, cancel its steps not yet run, and "
             "apply a cleanup plan that releases the workers it left between states.")]
    = None,
) -> None:
    """Apply a proposed plan if the fleet is still at the state it was computed against."""
    if abort_id is not None:
        if plan_id is not None or latest or wait:
            raise BadInput("--abort: give the plan to abort alone (no PLAN_ID, --latest or --wait)")
        _abort(abort_id, as_json)
        return
    if (plan_id is None) == (not latest):
        raise BadInput("PLAN_ID / --latest: give a plan id or --latest (one of them)")
    from pearl.controlplane.store.db import make_engine, require_schema, transaction
    from pearl.controlplane.store.plan_store import apply, plan_summary, wait_plan

    engine = make_engine(component="policy")
    try:
        require_schema(engine)
        applied = apply(engine, plan_id)
        if not as_json:
            out.print(f"plan {applied.plan_id} applying: {len(applied.ready)} step(s) ready "
                      f"({', '.join(applied.ready) or '-'}), {applied.blocked} waiting; "
                      f"woke the agents of {', '.join(applied.nodes) or 'no node'}")
        if wait:
            last: list[str] = []

            def progress(summary: dict[str, Any]) -> None:
                line = _step_counts(summary)
                if not last or last[-1] != line:
                    err.print(f"plan {applied.plan_id}: {summary['status']} ({line})", highlight=False)
                    last.append(line)

            summary = wait_plan(engine, applied.plan_id, timeout_s=timeout, poll_s=poll, on_poll=progress)
        else:
            with transaction(engine) as session:
                summary = plan_summary(session, applied.plan_id)
    finally:
        engine.dispose()
    if as_json:
        emit_json({"plan": summary, "ready": list(applied.ready), "blocked": applied.blocked,
                   "nodes": list(applied.nodes)})
    elif wait:
        out.print(f"plan {applied.plan_id} {summary['status']} ({_step_counts(summary)})")
    if summary["status"] == "failed":  # the result is printed (its JSON too): the failure is the exit status
        raise fail(str(StepFailed(f"plan {applied.plan_id} failed: {summary['error']}")), StepFailed.exit_code,
                   as_json=False)


def _abort(plan_id: int, as_json: bool) -> None:
    from pearl.controlplane.store.db import make_engine, require_schema, transaction
    from pearl.controlplane.store.plan_store import abort, plan_summary

    engine = make_engine(component="policy")
    try:
        require_schema(engine)
        progress = abort(engine, plan_id)
        with transaction(engine) as session:
            summary = plan_summary(session, plan_id)
    finally:
        engine.dispose()
    if as_json:
        emit_json({"plan": summary, "cancelled": list(progress.cancelled), "release": list(progress.release),
                   "cleanup": progress.cleanup})
        return
    cleanup = (f"cleanup plan {progress.cleanup} releases workers {', '.join(map(str, progress.release))}"
               if progress.cleanup else "no worker to release")
    out.print(f"plan {plan_id} aborted ({_step_counts(summary)}); cancelled {len(progress.cancelled)} step(s); "
              f"{cleanup}", highlight=False)
