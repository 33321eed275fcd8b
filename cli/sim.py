"""`pearlctl sim run | compare | ratio`: the simulator from the command line.

The module imports the simulator only inside the commands, so `pearlctl --help` stays quick; the names
below (systems, table columns) are kept equal to the simulator's by tests/unit/test_cli_errors.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pearl.cli.common import emit_json, err, fail, handle_errors, out
from pearl.controlplane.errors import PearlError

if TYPE_CHECKING:  # Rich's tables are imported when a table is drawn
    from rich.table import Table

# name: what it is (sim/systems.py)
SYSTEM_HELP = {
    "roll": "reserved rollout GPUs only, colocated, static",
    "roll-large": "a fixed reserve: the reserved plus the trace's mean preemptible GPUs",
    "rlboost-plus": "reserved plus preemptible GPUs, elastic, colocated, no borrowing",
    "pearl": "adaptive PD mode and ratio, gated borrowing of the training GPUs, elastic",
    "oracle": "pearl's GPUs with hindsight and free reconfiguration (an upper bound)",
    "pearl-pd-only": "ablation: pearl without borrowing",
    "pearl-ungated": "ablation: pearl borrowing whenever the training GPUs are idle",
    "pearl-forced-split": "ablation: pearl always split",
}
_SHIPPED_SCENARIOS = Path(__file__).resolve().parent.parent / "sim" / "scenarios"

# The columns of the `sim run | compare` tables, in words (also in docs/formats.md).
COLUMNS = {
    "system": "the system simulated (`--policy`)",
    "tok/s": "the metric (the paper's per-step throughput): each training step's tokens (generated plus "
             "trained) over the time since the previous step ended, averaged over the steps after the first",
    "window": "the trained steps' tokens over duration_s (moves by whole steps on a short run)",
    "×roll": "tok/s divided by roll's",
    "×rlb+": "tok/s divided by rlboost-plus's",
    "steps": "rollout steps (batches) completed",
    "GPU·h": "GPU-hours held by rollout workers, dedicated and borrowed",
    "reconf": "reconfigurations: workers started, stopped or switched by plans (D_worker + D_role)",
    "late": "training steps delayed by borrowed GPUs that came back late",
    "forced": "preempted workers still serving at their deadline, released by force",
    "step s": "mean rollout-step makespan, seconds",
    "wall s": "seconds the simulation took on this machine",
}


def _shipped() -> str:
    return ", ".join(p.stem for p in sorted(_SHIPPED_SCENARIOS.glob("*.yaml"))) or "none"


ScenarioOpt = Annotated[str, typer.Option(
    "--scenario", help=f"Scenario file, or the name of a shipped one: {_shipped()}.")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a scenario key: key.path=value (the value is YAML), e.g. workload.batch_size=96.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Write a PNG timeline here (.png).")]
_COLUMNS_HELP = "\n\n".join(["Table columns:", *(f"{name}: {text}" for name, text in COLUMNS.items())])

sim_app = typer.Typer(help="Simulate a scenario: one system, all systems, or the PD-ratio table.",
                      no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(sim_app, name="sim")


class _Bar:
    """Progress on stderr over simulated time. In a terminal: one Rich bar per system, every system
    listed from the start. Otherwise: one line as each system starts and ends."""

    def __init__(self, duration_s: float, systems: list[str], enabled: bool | None = None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.duration_s = duration_s
        self.systems = systems
        self.live = err.is_terminal if enabled is None else enabled
        self.progress = Progress(TextColumn("{task.description:>18}"), BarColumn(),
                                 TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                                 console=err, disable=not self.live, transient=True)
        self.tasks: dict[str, Any] = {}
        self.started: dict[str, float] = {}
        self.done: set[str] = set()

    def __enter__(self) -> _Bar:
        self.progress.__enter__()
        if self.live:
            for name in self.systems:
                self.tasks[name] = self.progress.add_task(name, total=self.duration_s, start=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def _line(self, text: str) -> None:
        if not self.live:
            err.print(text, highlight=False, soft_wrap=True)

    def __call__(self, name: str, t: float) -> None:
        if name not in self.started:
            self.started[name] = time.perf_counter()
            self._line(f"simulating {name} ({len(self.started)}/{len(self.systems)}) over "
                       f"{self.duration_s:,.0f} simulated s ...")
            if name not in self.tasks:
                self.tasks[name] = self.progress.add_task(name, total=self.duration_s, start=False)
            self.progress.start_task(self.tasks[name])
        self.progress.update(self.tasks[name], completed=min(t, self.duration_s))
        if t >= self.duration_s and name not in self.done:
            self.done.add(name)
            self._line(f"{name} done in {time.perf_counter() - self.started[name]:.1f} s "
                       f"({len(self.done)}/{len(self.systems)})")


def _show(table: Table) -> None:
    """Tables keep their columns when stdout is a file or a pipe (Rich would assume 80 columns)."""
    if not out.is_terminal:
        out.width = max(out.width, 140)
    out.print(table)


def _table(title: str, rows: dict, ratios: bool) -> Table:
    from rich.table import Table

    table = Table(title=title, caption="the columns are explained by `pearlctl sim compare --help`",
                  caption_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in rows.items():
        vs_roll, vs_rlb = r.get("vs_roll"), r.get("vs_rlboost-plus")
        table.add_row(
            name, f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_window']:,.0f}",
            f"{vs_roll:.2f}" if ratios and vs_roll is not None else "-",
            f"{vs_rlb:.2f}" if ratios and vs_rlb is not None else "-",
            str(r["rollout_steps"]), f"{r['gpu_seconds'] / 3600:,.1f}", str(r["reconfigurations"]),
            str(r["late_returns"]), str(r["forced_releases"]),
            f"{r['mean_step_makespan_s']:.0f}" if r["mean_step_makespan_s"] is not None else "-",
            f"{r['wall_s']:.1f}",
        )
    return table


def _warn_idle(sc: Any, rows: dict[str, dict]) -> None:
    """A system that completed no training step gets a word on stderr, with the likely cause."""
    for name, row in rows.items():
        if row["tokens_per_s"] > 0:
            continue
        cause = ("cluster.reserved_rollout_gpus is 0, so it has no rollout GPU of its own"
                 if sc.cluster.reserved_rollout_gpus == 0 else
                 f"no training step completed within duration_s ({sc.duration_s:,.0f} s)")
        err.print(f"warning: {name}: 0 tokens/s: {cause}", highlight=False, soft_wrap=True)


_POLICY_HELP = "System to simulate: " + "; ".join(f"{name} ({text})" for name, text in SYSTEM_HELP.items()) + "."


@sim_app.command("run", epilog=_COLUMNS_HELP)
@handle_errors
def run(scenario: ScenarioOpt, policy: Annotated[str, typer.Option("--policy", help=_POLICY_HELP)],
        set_: SetOpt = None, json_: JsonOpt = False, plot: PlotOpt = None) -> None:
    """Simulate one system on a scenario."""
    from pearl.sim.experiments import run_system
    from pearl.sim.plot import check_path, plot_run
    from pearl.sim.scenario import load_scenario
    from pearl.sim.systems import system

    system(policy)  # unknown name: exit 2 before any work
    sc = load_scenario(scenario, set_ or [])
    if plot is not None:
        check_path(plot)
    with _Bar(sc.duration_s, [policy]) as bar:
        result = run_system(sc, policy, bar)
    if plot is not None:
        plot_run(result, plot)
    row = result.as_dict()
    _warn_idle(system(policy).cluster(sc), {policy: row})
    if json_:
        emit_json(row)
        return
    _show(_table(f"{sc.name}: {policy}", {policy: row}, ratios=False))
    if plot is not None:
        err.print(f"wrote {plot}")


@sim_app.command("compare", epilog=_COLUMNS_HELP)
@handle_errors
def compare(scenario: ScenarioOpt, set_: SetOpt = None, json_: JsonOpt = False, plot: PlotOpt = None,
            ablations: Annotated[bool, typer.Option("--ablations", help="Also run the ablations.")] = False,
            seeds: Annotated[int, typer.Option("--seeds", min=1, help="Run each system on this many seeds (the "
                                               "scenario's and the next ones); report means and 95% intervals.")] = 1,
            ) -> None:
    """Simulate every system on a scenario; ratios to roll and rlboost-plus. Progress goes to stderr
    (a bar per system in a terminal, a line per system otherwise)."""
    from pearl.sim.experiments import compare_seeds
    from pearl.sim.plot import check_path, plot_comparison
    from pearl.sim.scenario import load_scenario
    from pearl.sim.systems import ABLATIONS, SYSTEMS

    sc = load_scenario(scenario, set_ or [])
    if plot is not None:
        check_path(plot)
    names = [*SYSTEMS, *(ABLATIONS if ablations else ())]
    if seeds > 1:
        from pearl.sim.experiments import seeds_of

        names = [f"{n} (seed {s})" for s in seeds_of(sc, seeds) for n in names]
    with _Bar(sc.duration_s, names) as bar:
        seeded = compare_seeds(sc, seeds, ablations=ablations, progress=bar)
    comparison = seeded.runs[0]
    data = seeded.as_dict()
    if plot is not None:
        runs = {**comparison.systems, **comparison.ablations}
        summaries = {**data["systems"], **data.get("ablations", {})}
        intervals = {name: (summaries[name]["tokens_per_s"], *summaries[name]["tokens_per_s_ci95"])
                     for name in runs if summaries.get(name, {}).get("tokens_per_s_ci95")} if seeds > 1 else None
        plot_comparison(runs, plot, intervals if intervals and len(intervals) == len(runs) else None,
                        data.get("seeds"))
    _warn_idle(sc, {**data["systems"], **data.get("ablations", {})})
    bound = data["checks"].get("oracle_upper_bound")
    if json_:
        emit_json(data)
    else:
        _show(_table(f"{sc.name}: systems", data["systems"], ratios=True))
        if data.get("ablations"):
            _show(_table(f"{sc.name}: ablations", data["ablations"], ratios=True))
        if seeds > 1:
            for line in _interval_lines(data):
                out.print(line)
        if bound is not None:
            for line in _bound_lines(bound):
                out.print(line, markup=True, highlight=False)
        if plot is not None:
            err.print(f"wrote {plot}")
    if bound is not None and not bound["ok"]:  # the results are printed; the failed check is the exit status
        raise fail(_bound_failure(bound), PearlError.exit_code, as_json=False)


def _interval_lines(data: dict) -> list[str]:
    """Over several seeds: each system's mean and 95% interval, and each ratio's, saying when it spans 1."""
    lines = [f"over seeds {', '.join(map(str, data['seeds']))}: mean [95% interval]"]
    for group in ("systems", "ablations"):
        for name, r in (data.get(group) or {}).items():
            lo, hi = r["tokens_per_s_ci95"]
            parts = [f"{name}: {r['tokens_per_s']:,.0f} tok/s [{lo:,.0f}, {hi:,.0f}]"]
            for base in ("roll", "rlboost-plus"):
                ci = r.get(f"vs_{base}_ci95")
                if ci is None or name == base:
                    continue
                note = " (spans 1)" if r[f"vs_{base}_spans_1"] else ""
                parts.append(f"×{base} {r[f'vs_{base}']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]{note}")
            lines.append("  " + "; ".join(parts))
    return lines


def _bound_lines(bound: dict) -> list[str]:
    """The oracle check in words: passed (with the worst step margin), or what beat the oracle."""
    steps = bound["step_ends"]
    worst = steps["worst"]
    margin = (f"; worst step margin {worst['margin']:+.2%} ({worst['system']}, training step {worst['step']})"
              if worst is not None else "")
    if bound["ok"]:
        return [f"[green]check: oracle >= every other system over the window, and no training step ends more "
                f"than {steps['tolerance']:.0%} later{margin}[/]"]
    lines = []
    if bound["violations"]:
        beaten = ", ".join(f"{v['system']} ({v['tokens_per_s_window']:,.0f} tok/s)" for v in bound["violations"])
        lines.append(f"[bold red]CHECK FAILED: the oracle "
                     f"({bound['violations'][0]['oracle_tokens_per_s_window']:,.0f} tok/s over the window) is "
                     f"below {beaten}[/]")
    if steps["violations"]:
        late = ", ".join(f"step {v['step']} vs {v['system']} ({v['oracle_end_s']:,.0f} s > {v['end_s']:,.0f} s)"
                         for v in steps["violations"][:5])
        more = len(steps["violations"]) - 5
        lines.append(f"[bold red]CHECK FAILED: the oracle ends training steps more than {steps['tolerance']:.0%} "
                     f"later: {late}{f' and {more} more' if more > 0 else ''}[/]")
    return lines


def _bound_failure(bound: dict) -> str:
    """One line for stderr: why `oracle_upper_bound` failed."""
    parts = []
    if bound["violations"]:
        names = ", ".join(v["system"] for v in bound["violations"])
        parts.append(f"{names} above the oracle's tokens/s over the window")
    steps = bound["step_ends"]
    if steps["violations"]:
        worst = steps["worst"]
        parts.append(f"{len(steps['violations'])} training step ends more than {steps['tolerance']:.0%} later than "
                     f"another system's (worst {worst['margin']:+.2%}: step {worst['step']} vs {worst['system']})")
    return "sim compare: the oracle check (oracle_upper_bound) failed: " + "; ".join(parts)


@sim_app.command("ratio")
@handle_errors
def ratio(
    scenario: ScenarioOpt,
    set_: SetOpt = None,
    json_: JsonOpt = False,
    overlap: Annotated[bool, typer.Option("--overlap", help="Add every training GPU to the budget.")] = False,
    steps: Annotated[int | None, typer.Option(
        "--steps", help="Rollout steps measured per candidate after the warm-up (default: as many as the "
                        "profiling run finishes within duration_s).")] = None,
    profile_workers: Annotated[int | None, typer.Option(
        "--profile-workers",
        help="Workers of the colocated profiling run (default: one fewer than the budget).")] = None,
    jobs: Annotated[int, typer.Option("--jobs", help="Processes simulating the candidates (0: one per CPU).")] = 0,
) -> None:
    """The paper's Table 2: the PD configuration the predictor selects for a fixed budget, beside every
    candidate's simulated makespan."""
    from pearl.sim.ratio import budget_workers
    from pearl.sim.ratio import ratio as ratio_table
    from pearl.sim.scenario import load_scenario
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    sc = load_scenario(scenario, set_ or [])
    progress = Progress(TextColumn("{task.description:>18}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=err, disable=not err.is_terminal, transient=True)
    with progress:
        task = progress.add_task("candidates", total=max(1, budget_workers(sc, overlap)))
        result = ratio_table(sc, overlap, steps=steps, profile_workers=profile_workers, jobs=jobs,
                             progress=lambda label: progress.advance(task))
    data = result.as_dict()
    if json_:
        emit_json(data)
        return
    table = Table(title=f"{sc.name}: {data['budget_gpus']} GPUs{' with overlap' if overlap else ''}, "
                        f"{data['budget_workers']} workers of tp={sc.tp}")
    for col in ("config", "predicted s", "paper s", "simulated s", "error", "note"):
        table.add_column(col, justify="left" if col in ("config", "note") else "right")
    for c in data["candidates"]:
        marks = [m for m, on in (("◀ selected", c["config"] == data["selected"]),
                                 ("★ best", c["config"] == data["empirical_best"])) if on]
        if not c["feasible"]:
            marks.append(c["reason"])
        error = c["predicted_s"] / c["simulated_s"] - 1
        table.add_row(c["config"], f"{c['predicted_s']:.1f}", f"{c['paper_s']:.1f}", f"{c['simulated_s']:.1f}",
                      f"{error:+.1%}", "  ".join(marks))
    _show(table)
    gap = f"{data['gap']:.2%}" if data["gap"] is not None else "-"
    out.print(f"selected {data['selected']}, empirical best {data['empirical_best']}, gap {gap}; "
              f"MAPE {data['mape']:.1%} (the paper's formulas {data['paper_mape']:.1%}, selecting "
              f"{data['paper_selected']}); profile: {data['profile_config']} over {data['profile_steps']} steps; "
              f"{data['measured_steps']} steps measured per candidate after {data['warmup_steps']} warm-up")
