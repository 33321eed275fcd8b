"""`pearlctl plan [--json] [--explain] [--dry-run]`: one pass of the policy engine; writes a proposed plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from .common import emit_json, handle_errors, out

if TYPE_CHECKING:
    from pearl.policies.live.policy_pass import Planned


# The words `plan --explain` and the plan table use (also in docs/formats.md, "plan --explain").
TERMS = {
    "state_version": "the fleet's version; every change to GPUs, workers, leases or training steps raises it",
    "profile": "what the prediction rests on: fitted (from telemetry), measured (timed kernels) or catalog",
    "dedicated worker": "a worker slot on rollout or granted preemptible GPUs",
    "overlap worker": "a worker slot on training GPUs, borrowable between optimizer steps",
    "B": "trajectories per rollout step (the batch)",
    "S": "mean turns per trajectory",
    "r": "mean tokens generated per turn",
    "dL": "mean tokens a turn adds to the context (observation plus reply): the method's ΔL",
    "config": "colocated xN: N servers each prefilling and decoding; aPbD: a prefill and b decode servers",
    "predicted": "pearl's predicted makespan of one rollout step in that configuration, seconds",
    "paper": "the same from the paper's closed-form formulas, for comparison",
    "note": "why a candidate is infeasible, or `round model` when only the coarse model ranked it",
    "* / =": "the chosen configuration / the one running now",
    "R/B": "the share of the step's trajectories still unfinished",
    "T_ded, T_full": "predicted makespan on the dedicated workers alone, and with the overlap workers added",
    "T_toggle": "the measured cost of one borrow cycle (lend and return a training GPU's worker)",
    "gate": "borrow iff (R/B) x (T_ded - T_full) > T_toggle",
    "base_version": "the state_version the plan was computed at; applying it later than that is refused as stale",
    "D_worker, D_role": "workers the plan starts or stops, and workers whose role it switches",
    "key, action, worker, node": "a plan step: its name, what it does, the worker slot and its node",
    "args, after, group": "the step's arguments, the steps it waits for, and the expansion group admitted "
                          "together",
}
_TERMS_HELP = "\n\n".join(["Terms of --explain and the plan table:", *(f"{k}: {v}" for k, v in TERMS.items())])


def register(app: typer.Typer) -> None:
    app.command("plan", epilog=_TERMS_HELP)(plan_command)


def render(planned: Planned) -> Table | Text:
    if planned.plan.empty:
        return Text(f"no change: {planned.target.reason}")
    title = (f"plan {planned.plan_id} (proposed" if planned.plan_id else "plan (dry run, not written") + \
        f"; base_version {planned.plan.base_version}, D_worker {planned.plan.d_worker}, D_role {planned.plan.d_role})"
    table = Table(title=title)
    for col in ("key", "action", "worker", "node", "args", "after", "group"):
        # one argument and one dependency a line; a narrow terminal folds a cell, never cuts it short
        table.add_column(col, overflow="fold")
    for s in planned.plan.steps:
        args = "\n".join(f"{k}={v}" for k, v in s.args.items())
        after = "\n".join(s.after) if len(s.after) <= 2 else f"{len(s.after)} steps"
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

    engine = make_engine(component="policy")
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
    if not out.is_terminal:  # piped or redirected: the table's full width (Rich would assume 80 columns)
        out.width = max(out.width, 140)
    out.print(render(planned))
    if planned.plan_id:
        out.print(f"apply it with `pearlctl apply {planned.plan_id}` (decision {planned.decision_id})")
