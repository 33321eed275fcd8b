"""`pearlctl plan [--json] [--explain] [--dry-run]`: one pass of the policy engine; writes a proposed plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from .common import emit_json, handle_errors, out

if TYPE_CHECKING:
    from pearl.policies.live.policy_pass import Planned


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)


def render(planned: Planned) -> Table | Text:
    if planned.plan.empty:
        return Text(f"no change: {planned.target.reason}")
    title = (f"plan {planned.plan_id} (proposed" if planned.plan_id else "plan (dry run, not written") + \
        f"; base_version {planned.plan.base_version}, D_worker {planned.plan.d_worker}, D_role {planned.plan.d_role})"
    table = Table("key", "action", "worker", "node", "args", "after", "group", title=title)
    for s in planned.plan.steps:
        args = " ".join(f"{k}={v}" for k, v in s.args.items())
        after = ", ".join(s.after) if len(s.after) <= 2 else f"{len(s.after)} steps"
        table.add_row(s.key, str(s.action), str(s.worker_id), s.node, args, after, s.group or "")
    return table


@handle_errors
def plan_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="Show the ranked candidates and why one won.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Decide and show; write nothing.")] = False,
) -> None:
    """Decide the fleet's next configuration (PEARL policy) and write it as a proposed plan."""
    from pearl.controlplane.store.db import make_engine, require_schema
    from pearl.controlplane.store.plan_store import PlanNotApplicable, applying_plan
    from pearl.policies.live.policy_pass import plan, written_plan

    engine = make_engine()
    try:
        require_schema(engine)
        busy = None if dry_run else applying_plan(engine)
        if busy is not None:
            raise PlanNotApplicable(
                f"plan {busy} is still applying: a plan written now would be computed against a fleet that plan "
                f"{busy} is changing, and could never apply; nothing was written. Watch it finish with `pearlctl "
                f"status --watch` (or give it up with `pearlctl apply --abort {busy}`), then plan again; "
                "`pearlctl plan --dry-run` shows what would be decided now")
        planned = plan(engine, dry_run=dry_run)
        stored = written_plan(engine, planned)
    finally:
        engine.dispose()
    if as_json:
        obj = planned.as_dict(stored)
        obj["dry_run"] = dry_run
        if explain:
            obj["explain"] = planned.explain()
        emit_json(obj)
        return
    if explain:
        out.print(planned.explain(), markup=False, highlight=False)
        out.print()
    out.print(render(planned))
    if planned.plan_id:
        out.print(f"apply it with `pearlctl apply {planned.plan_id}` (decision {planned.decision_id})")
