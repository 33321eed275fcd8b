"""`pearlctl status [--json] [--watch]`: the fleet at one state_version.

In a terminal the tables fit its width (columns a narrow terminal cannot hold are left out, never
cut), and `--watch` keeps the summary and the plan line at the top, listing only the workers that fit
its height. Piped, `--watch` prints one plain line per change.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .common import emit_json, handle_errors, out

_STATE_STYLE = {"free": "green", "bound": "cyan", "borrowed": "magenta", "training": "yellow", "draining": "orange3",
                "unavailable": "dim", "revoked": "red", "lost": "bold red"}


def register(app: typer.Typer) -> None:
    app.command("status")(status)


def _counts(counts: dict[str, int]) -> str:
    """{'ready': 10, 'blocked': 21} as `10 ready, 21 blocked`."""
    return ", ".join(f"{n} {state}" for state, n in counts.items()) or "none"


def plan_line(p: dict[str, Any] | None) -> str:
    if not p:
        return "latest plan: none"
    return (f"latest plan: #{p['id']} {p['status']} (base_version {p['base_version']}, D_worker {p['d_worker']}, "
            f"D_role {p['d_role']}; steps: {_counts(p['steps'])})")


def summary_line(s: dict[str, Any]) -> str:
    """The fleet in one line: what `--watch` prints when piped."""
    return (f"state_version {s['state_version']}  GPUs {s['gpus']['total']}: {_counts(s['gpus']['by_state'])}  "
            f"workers {len(s['workers'])}  {plan_line(s['plan'])}")


# Workers columns in the order a narrow terminal drops them (the last first): id, node, role and
# activity are always shown.
_WORKER_COLUMNS = ("id", "node", "role", "activity", "gpu state", "weights", "lag", "zone", "slot", "devices",
                   "sync")
_WORKER_WIDTH = {"id": 4, "node": 10, "role": 10, "activity": 12, "gpu state": 11, "weights": 9, "lag": 4,
                 "zone": 11, "slot": 6, "devices": 9, "sync": 12}


def _worker_columns(width: int) -> list[str]:
    cols, used = [], 4
    for col in _WORKER_COLUMNS:
        if cols[:4] == list(_WORKER_COLUMNS[:4]) and used + _WORKER_WIDTH[col] > width:
            break
        cols.append(col)
        used += _WORKER_WIDTH[col] + 3
    return cols


def render(s: dict[str, Any], width: int | None = None, max_workers: int | None = None) -> Group:
    """Rich tables: cluster and GPUs by zone and state, the latest plan, workers, open leases.

    `width`: the terminal's columns (workers columns that do not fit are left out); `max_workers`:
    list at most this many workers (the rest are counted)."""
    width = width or out.width
    c = s["cluster"]
    head = Text(f"state_version {s['state_version']}   model {c['model'] or '-'}   gpu {c['gpu'] or '-'}   "
                f"tp {c['tp'] or '-'}   GPUs {s['gpus']['total']}", style="bold")
    states = sorted(s["gpus"]["by_state"])
    gpus = Table("zone", *states, "total", title="GPUs by zone and state")
    for zone, counts in s["gpus"]["by_zone_state"].items():
        gpus.add_row(zone, *(Text(str(counts.get(st, 0)), style=_STATE_STYLE.get(st, "")) for st in states),
                     str(s["gpus"]["by_zone"][zone]))
    cols = _worker_columns(width)
    shown = s["workers"] if max_workers is None else s["workers"][:max(0, max_workers)]
    hidden = len(s["workers"]) - len(shown)
    workers = Table(title=f"Workers (trainer at weights version {s.get('trainer_version', 0)})"
                    + (f", first {len(shown)} of {len(s['workers'])}" if hidden else ""))
    for col in cols:
        workers.add_column(col, no_wrap=True)
    for w in shown:
        gpu_states = list(dict.fromkeys(w["gpu_states"]))  # one word when they agree, as usual
        cells = {"id": str(w["id"]), "node": w["node"], "slot": str(w["slot"]), "zone": w["zone"], "role": w["role"],
                 "activity": w["activity"], "devices": ",".join(map(str, w["devices"])),
                 "gpu state": Text("/".join(gpu_states),
                                   style=_STATE_STYLE.get(gpu_states[0], "") if gpu_states else ""),
                 "weights": str(w["weights_version"]), "lag": _lag(w.get("weights_lag", 0)),
                 "sync": _sync(w.get("sync"))}
        workers.add_row(*(cells[col] for col in cols))
    parts: list[Any] = [head, Text(plan_line(s["plan"])), gpus, workers]
    p = s["plan"]
    if p and p.get("running"):
        running = Table("step", "worker", "node", "agent", "attempt", "lease until",
                        title=f"Plan #{p['id']} in progress")
        for r in p["running"]:
            running.add_row(r["key"], str(r["worker"]), r["node"], str(r["agent"] or "-"), str(r["attempts"]),
                            r["lease_until"] or "")
        parts.append(running)
    if s.get("agents"):
        agents = Table("agent", "node", "host", "pid", "driver", "heartbeat", "stopped", title="Agents")
        for a in s["agents"]:
            agents.add_row(str(a["id"]), a["node"], a["host"], str(a["pid"]), a["driver"],
                           f"{a['heartbeat_age_s']:.1f} s ago", a["stopped_at"] or "")
        parts.append(agents)
    if s.get("router"):
        r = s["router"]
        stopped = (f", stopped at {r['stopped_at']}: restarting, or stopped on purpose" if r["stopped_at"] else
                   f", silent for {r['heartbeat_age_s']:.0f} s: killed?" if not r["running"] else "")
        parts.append(Text(f"front door: {r['url']} (mode {r['mode'] or '-'}{stopped})"))
    if s["leases"]:
        leases = Table("id", "kind", "node", "device", "granted", "deadline", title="Open leases")
        for lease in s["leases"]:
            leases.add_row(str(lease["id"]), lease["kind"], lease["node"], str(lease["device"]),
                           lease["granted_at"] or "", lease["deadline"] or "")
        parts.append(leases)
    return Group(*parts)


def _lag(lag: int) -> Text:
    return Text(str(lag), style="yellow" if lag else "green")


def _sync(sync: dict[str, Any] | None) -> Text:
    if not sync:
        return Text("-", style="dim")
    style = {"done": "green", "failed": "red", "running": "cyan", "queued": "yellow"}.get(sync["state"], "dim")
    return Text(f"v{sync['version']} {sync['state']}", style=style)


def _watch(engine: Any, interval: float) -> None:
    from pearl.controlplane.store.fleet_status import read_fleet_status

    if not out.is_terminal:  # piped: one plain line whenever something changed
        last = None
        try:
            while True:
                line = summary_line(read_fleet_status(engine))
                if line != last:
                    out.print(f"{datetime.now():%H:%M:%S} {line}", highlight=False, soft_wrap=True)
                    out.file.flush()
                    last = line
                time.sleep(interval)
        except KeyboardInterrupt:
            return
    from rich.live import Live

    def frame() -> Group:
        # the summary, plan line and GPU table stay on screen; the workers that fit below them are listed
        s = read_fleet_status(engine)
        fixed = 9 + len(s["gpus"]["by_zone_state"]) + (len(s["leases"]) + 4 if s["leases"] else 0)
        return render(s, width=out.width, max_workers=max(1, out.height - fixed - 6))

    with Live(frame(), console=out, auto_refresh=False, vertical_overflow="crop") as live:
        try:
            while True:
                time.sleep(interval)
                live.update(frame(), refresh=True)
        except KeyboardInterrupt:
            pass


@handle_errors
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until interrupted (piped: one line per "
                                                        "change).")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes.")] = 2.0,
) -> None:
    """Show GPUs by zone and state, worker slots, the latest plan and open leases.

    GPU states: free (idle), bound (held by an active worker), borrowed (a training GPU lent to
    rollout), training (running the optimizer), draining (finishing its requests before release),
    unavailable (a preemptible GPU not granted), revoked (taken back by the provider), lost."""
    if as_json and watch:
        raise typer.BadParameter("--json and --watch do not combine", param_hint="--watch")
    from pearl.controlplane.store.db import make_engine, require_schema
    from pearl.controlplane.store.fleet_status import read_fleet_status

    engine = make_engine(component="audit")
    try:
        require_schema(engine)
        if as_json:
            emit_json(read_fleet_status(engine))
        elif not watch:
            out.print(render(read_fleet_status(engine)))
        else:
            _watch(engine, interval)
    finally:
        engine.dispose()
