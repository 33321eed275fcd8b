"""`pearlctl status [--json] [--watch]`: the fleet at one state_version."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from pearl.controlplane.store.db import make_engine, require_schema
from pearl.controlplane.store.fleet_status import read_fleet_status
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .common import emit_json, handle_errors, out

_STATE_STYLE = {"free": "green", "bound": "cyan", "borrowed": "magenta", "training": "yellow", "draining": "orange3",
                "unavailable": "dim", "revoked": "red", "lost": "bold red"}


def register(app: typer.Typer) -> None:
    app.command("status")(status)


def render(s: dict[str, Any]) -> Group:
    """Rich tables: cluster and GPUs by zone and state, workers, latest plan, open leases."""
    c = s["cluster"]
    head = Text(f"state_version {s['state_version']}   model {c['model'] or '-'}   gpu {c['gpu'] or '-'}   "
                f"tp {c['tp'] or '-'}   GPUs {s['gpus']['total']}", style="bold")
    states = sorted(s["gpus"]["by_state"])
    gpus = Table("zone", *states, "total", title="GPUs by zone and state")
    for zone, counts in s["gpus"]["by_zone_state"].items():
        gpus.add_row(zone, *(Text(str(counts.get(st, 0)), style=_STATE_STYLE.get(st, "")) for st in states),
                     str(s["gpus"]["by_zone"][zone]))
    workers = Table("id", "node", "slot", "zone", "role", "activity", "devices", "gpu state", "weights", "lag",
                    "sync", title=f"Workers (trainer at weights version {s.get('trainer_version', 0)})")
    for w in s["workers"]:
        gpu_states = list(dict.fromkeys(w["gpu_states"]))  # one word when they agree, as usual
        workers.add_row(str(w["id"]), w["node"], str(w["slot"]), w["zone"], w["role"], w["activity"],
                        ",".join(map(str, w["devices"])),
                        Text("/".join(gpu_states), style=_STATE_STYLE.get(gpu_states[0], "") if gpu_states else ""),
                        str(w["weights_version"]), _lag(w.get("weights_lag", 0)), _sync(w.get("sync")))
    parts: list[Any] = [head, gpus, workers]
    p = s["plan"]
    parts.append(Text(f"latest plan: #{p['id']} {p['status']} (base_version {p['base_version']}, "
                      f"D_worker {p['d_worker']}, D_role {p['d_role']}, steps {p['steps']})") if p
                 else Text("latest plan: none"))
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
        parts.append(Text(f"front door: {s['router']['url']} (mode {s['router']['mode'] or '-'})"))
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


@handle_errors
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until interrupted.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes.")] = 2.0,
) -> None:
    """Show GPUs by zone and state, worker slots, the latest plan and open leases."""
    if as_json and watch:
        raise typer.BadParameter("--json and --watch do not combine", param_hint="--watch")
    engine = make_engine()
    try:
        require_schema(engine)
        if as_json:
            emit_json(read_fleet_status(engine))
        elif not watch:
            out.print(render(read_fleet_status(engine)))
        else:
            with Live(render(read_fleet_status(engine)), console=out, auto_refresh=False) as live:
                try:
                    while True:
                        time.sleep(interval)
                        live.update(render(read_fleet_status(engine)), refresh=True)
                except KeyboardInterrupt:
                    pass
    finally:
        engine.dispose()
