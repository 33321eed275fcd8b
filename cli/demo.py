"""`pearlctl demo`: the whole system live on this machine (agents/demo.py), a live view, a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pearl.controlplane.errors import BadInput
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .common import emit_json, err, handle_errors, out


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@handle_errors
def demo(
    scenario: Annotated[str, typer.Option("--scenario", help="A scenario file or a shipped name.")]
    = "demo-qwen3-30b-a3b-seg2",
    speed: Annotated[float, typer.Option("--speed", help="Model seconds per wall second (time compression).")]
    = 10.0,
    duration: Annotated[float | None, typer.Option(
        "--duration", help="Model seconds to run (default: the scenario's duration_s).")] = None,
    steps: Annotated[int | None, typer.Option(
        "--steps", help="End the run after this many training steps, or at --duration if that comes first "
                        "(the simulator, whose window is the duration, is then not run).")] = None,
    simulate: Annotated[bool, typer.Option("--simulate/--no-simulate",
                                           help="Run the simulator beside, on the same scenario.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the run's timeline as a PNG.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Change the scenario, KEY=VALUE (repeat), as `sim compare --set`: e.g. "
                      "cluster.preemptible.notice_s=60.")] = None,
) -> None:
    """Run pearl live on this machine: PostgreSQL and Redis (embedded unless configured), the front door
    over the real SGLang router, one agent and one weight-sync worker per node, simulated SGLang servers,
    the policy loop, and a trainer that sends the scenario's multi-turn trajectories; then compare it with
    the simulator on the same work."""
    from pearl.agents.demo import Demo, DemoConfig

    if not 0.1 <= speed <= 1000:
        raise BadInput(f"--speed: between 0.1 and 1000 model seconds per wall second, not {speed:g}")
    if duration is not None and not 0 < duration <= 86400:
        raise BadInput(f"--duration: between 0 and 86400 model seconds, not {duration:g}")
    if steps is not None and not 1 <= steps <= 100_000:
        raise BadInput(f"--steps: between 1 and 100000 training steps, not {steps}")
    if plot is not None and plot.suffix.lower() != ".png":
        raise BadInput(f"--plot: a .png file, not {plot}")
    from pearl.sim.scenario import load_scenario

    load_scenario(scenario, list(overrides or []))  # a bad scenario or override is refused before anything starts
    from rich.live import Live

    live = Live(Text("starting the live system..."), console=err, auto_refresh=False, transient=False)

    def view(status: dict[str, Any], stats: Any, model_s: float) -> None:
        live.update(Group(_render(status, stats, model_s, speed),
                          Text(f"dashboard: {runner.dashboard_url}" if runner.dashboard_url else "")), refresh=True)

    runner = Demo(DemoConfig(scenario=scenario, speed=speed, duration_s=duration, simulate=simulate,
                             steps=steps, overrides=tuple(overrides or ())),
                  view=view if err.is_terminal else None)
    with live if err.is_terminal else _nothing():
        result = runner.run()
    s = result.summary
    if plot is not None:
        _plot(result, plot)
    if as_json:
        emit_json(s)
    else:
        out.print(_summary_table(s))
        if s.get("dashboard"):
            out.print(f"the dashboard was at {s['dashboard']} while the demo ran (`pearlctl dashboard` serves it "
                      "over the rows any time)", highlight=False)
        out.print(f"\nthe run's rows stay in {s['database']}; worth running there "
                  f"(psql \"{_psql(result.database_url)}\"):", highlight=False)
        from pearl.agents.demo import QUERIES

        for what, sql in QUERIES:
            out.print(f"  -- {what}\n  {sql}", highlight=False, markup=False)
        if runner.started:
            out.print(f"(the embedded {' and '.join(runner.started)} the demo started are stopped again; "
                      "`pearlctl db start` brings them back)", highlight=False)
    if result.died is not None:
        from pearl.agents.demo import ComponentDied

        raise ComponentDied(f"{result.died.name} died (exit {result.died.popen.returncode}); everything was "
                            f"stopped. Its last lines:\n{result.died.tail()}")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def _psql(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _render(status: dict[str, Any], stats: Any, model_s: float, speed: float) -> Group:
    if stats is None:
        head = Text("warming up: the policy's first fleet is starting (the clock starts once it serves)",
                    style="bold")
    else:
        step, finished, batch = stats.rollout
        rate = stats.trained_tokens / model_s if model_s > 0 else 0.0
        head = Text(f"model time {model_s:7.0f} s (x{speed:g})   rollout step {max(step, 0)}: {finished}/{batch} "
                    f"done   training: {stats.training}   trained steps {stats.training_steps}   tokens/s {rate:,.0f}"
                    f"   requests {stats.requests} (resubmitted {stats.resubmitted}, failed {stats.failed_requests})",
                    style="bold")
    gpus = Table("zone", "free", "bound", "borrowed", "training", "draining", "unavailable", "revoked",
                 title="GPUs", title_justify="left")
    for zone, counts in status["gpus"]["by_zone_state"].items():
        gpus.add_row(zone, *(str(counts.get(k, 0)) for k in
                             ("free", "bound", "borrowed", "training", "draining", "unavailable", "revoked")))
    workers = Table("worker", "node", "zone", "role", "activity", "weights", title="Workers", title_justify="left")
    for w in status["workers"]:
        style = {"active": "green", "transitioning": "yellow"}.get(w["activity"], "dim")
        workers.add_row(str(w["id"]), w["node"], w["zone"], w["role"], Text(w["activity"], style=style),
                        str(w["weights_version"]))
    p = status["plan"]
    plan = Text(f"plan {p['id']} {p['status']}: {p['steps']}" + (f" - {p['error']}" if p.get("error") else "")
                if p else "no plan yet")
    borrowed = [lease for lease in status["leases"] if lease["kind"] == "borrowed"]
    lent = Text(f"borrowed training GPUs: {len(borrowed)}"
                + (f", due back by {min(x['deadline'] for x in borrowed if x['deadline'])}"
                   if any(x["deadline"] for x in borrowed) else ""))
    return Group(head, gpus, workers, plan, lent)


def _summary_table(s: dict[str, Any]) -> Group:
    live = Table("", "live", "simulated", title=f"pearl live: {s['scenario']}, {s['model_s']:.0f} model s in "
                 f"{s['wall_s']:.0f} s (x{s['speed']:g})", title_justify="left")
    sim = (s.get("systems") or {}).get("pearl") or {}
    live.add_row("rollout steps", str(s["rollout_steps"]), str(sim.get("rollout_steps", "-")))
    live.add_row("plans applied", str(s["plans_applied"]), str(sim.get("reconfigurations", "-")) + " changes")
    for key in ("weight_syncs", "borrowed_returns", "late_returns", "failed_requests"):
        live.add_row(key.replace("_", " "), str(s[key]), "")
    live.add_row("invariant violations", str(len(s["violations"])), "")
    for key, label in (("tokens_per_s", "tokens/s (per step)"), ("tokens_per_s_ratio_of_sums", "  ratio of sums"),
                       ("tokens_per_s_window", "  over the run")):
        simulated = s.get(f"simulated_{key}")
        ratio = f" ({s[key] / simulated:.2f}x)" if simulated else ""
        live.add_row(label, f"{s[key]:,.0f}{ratio}", f"{simulated:,.0f}" if simulated else "-")
    parts: list[Any] = [live]
    if s.get("systems"):
        systems = Table("system", "tokens/s", "rollout steps", "GPU-seconds", "reconfigurations",
                        title="the simulator on the same scenario", title_justify="left")
        for name, v in s["systems"].items():
            systems.add_row(name, f"{v['tokens_per_s']:,.0f}", str(v["rollout_steps"]), f"{v['gpu_seconds']:,.0f}",
                            str(v["reconfigurations"]))
        parts.append(systems)
    if s.get("steps") and s["training_steps"] >= s["steps"]:
        parts.append(Text(f"ended after {s['training_steps']} training steps (--steps)"))
    if s.get("stopped"):
        parts.append(Text(f"stopped early: {s['stopped']}", style="yellow"))
    for v in s["violations"]:
        parts.append(Text(f"invariant {v['invariant']} [{v['check']}] {v['detail']}", style="red"))
    return Group(*parts)


def _plot(result: Any, path: Path) -> None:
    """The run's timeline: workers serving by zone, and the tokens generated (model seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = result.summary["speed"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    changes = result.activity
    if changes:
        from datetime import UTC, datetime

        t0 = datetime.fromtimestamp(result.started_at, UTC)  # the trainer's clock: 0 when the run starts
        state: dict[int, tuple[str, str]] = {}
        xs, dedicated, overlap = [], [], []
        for c in changes:
            state[c["worker_id"]] = (c["zone"], c["activity"])
            xs.append((c["at"] - t0).total_seconds() * speed)
            dedicated.append(sum(1 for z, a in state.values() if z == "dedicated" and a == "active"))
            overlap.append(sum(1 for z, a in state.values() if z == "overlap" and a == "active"))
        top.step(xs, dedicated, where="post", label="dedicated workers serving", color="tab:blue")
        top.step(xs, overlap, where="post", label="borrowed (overlap) workers serving", color="tab:orange")
        top.legend(loc="upper left", fontsize=8, framealpha=0.8)
    top.set_ylabel("workers")
    top.set_title(f"pearl live: {result.summary['scenario']}, {result.summary['tokens_per_s']:,.0f} tokens/s "
                  f"(time in model seconds, x{speed:g} the wall clock)")
    if result.tokens:
        bottom.plot([t * speed for t, _ in result.tokens], [n for _, n in result.tokens],
                    color="tab:green", label="tokens generated")
        bottom.legend(loc="upper left", fontsize=8, framealpha=0.8)
    bottom.set_xlabel("model seconds since the run started (before 0: the first fleet starting)")
    bottom.set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
