"""`pearlctl sim run | compare`: JSON contracts, tables, plots, and bad input (exit 2, the key named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pearl.cli.app import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

RUN_KEYS = {"scenario", "policy", "tokens_per_s", "rollout_steps", "gpu_seconds", "reconfigurations"}
SHORT = ["--set", "duration_s=1200"]
TINY = ["--set", "duration_s=900", "--set", "workload.batch_size=16"]  # for compare: the oracle searches each step
SYSTEMS = {"roll", "roll-large", "rlboost-plus", "pearl", "oracle"}


_RUNS: dict[tuple[str, str, str], object] = {}


@pytest.fixture(autouse=True)
def shared_runs(monkeypatch):
    """One simulation per (scenario, system) for the whole module: `sim run` and `sim compare` in
    several tests read the same deterministic runs (tests that need a process of their own still
    simulate there). A reused run reports its progress as finished."""
    from pearl.sim import experiments

    simulate = experiments.run_system

    def run_system(scenario, name, progress=None):
        key = (str(scenario.source), scenario.model_dump_json(), name)
        if key not in _RUNS:
            _RUNS[key] = simulate(scenario, name, progress)
        elif progress is not None:
            progress(name, scenario.duration_s)
        return _RUNS[key]

    monkeypatch.setattr(experiments, "run_system", run_system)


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, list(args))

    return invoke


def test_run_json_is_one_object_with_the_required_keys(cli):
    res = cli("sim", "run", "--scenario", "paper-qwen3-8b-seg2", "--policy", "rlboost-plus", *SHORT, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert RUN_KEYS <= data.keys()
    assert data["policy"] == "rlboost-plus" and data["scenario"] == "paper-qwen3-8b-seg2"
    assert data["tokens_per_s"] > 0 and data["gpu_seconds"] > 0


def test_set_overrides_reach_the_simulation(cli):
    small = json.loads(cli("sim", "run", "--scenario", "paper-qwen3-8b-seg2", "--policy", "roll", *SHORT,
                           "--set", "cluster.reserved_rollout_gpus=2", "--json").stdout)
    assert small["gpu_seconds"] == pytest.approx(2 * 1200)


def test_compare_json_has_every_system_and_the_ratios(cli):
    res = cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["scenario"] == "paper-qwen3-8b-seg1"
    assert set(data["systems"]) == SYSTEMS
    bound = data["checks"]["oracle_upper_bound"]
    assert bound["ok"] is True and bound["violations"] == [] and bound["step_ends"]["violations"] == []
    assert bound["step_ends"]["worst"]["margin"] >= -bound["step_ends"]["tolerance"]
    for row in data["systems"].values():
        assert RUN_KEYS - {"scenario", "policy"} <= row.keys()
    assert data["systems"]["roll"]["vs_roll"] == 1.0
    rlb = data["systems"]["rlboost-plus"]
    assert rlb["vs_roll"] == pytest.approx(rlb["tokens_per_s"] / data["systems"]["roll"]["tokens_per_s"], rel=1e-3)
    assert "ablations" not in data
    with_ablations = json.loads(cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY, "--ablations",
                                    "--json").stdout)
    assert set(with_ablations["ablations"]) == {"pearl-pd-only", "pearl-ungated", "pearl-forced-split"}
    assert set(with_ablations["systems"]) == SYSTEMS
    for row in with_ablations["ablations"].values():
        assert RUN_KEYS - {"scenario", "policy"} <= row.keys() and "vs_rlboost-plus" in row


def test_compare_over_seeds_reports_means_and_intervals(cli):
    res = cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY, "--seeds", "2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["seeds"] == [1, 2]  # the scenario's seed, then the next
    for name, row in data["systems"].items():
        per_seed = row["tokens_per_s_per_seed"]
        assert row["seeds"] == 2 and len(per_seed) == 2
        assert row["tokens_per_s"] == pytest.approx(sum(per_seed) / 2, abs=0.1)
        low, high = row["tokens_per_s_ci95"]
        assert low <= row["tokens_per_s"] <= high
        for key in ("tokens_per_s_window", "tokens_per_s_ratio_of_sums"):
            assert row[key] == pytest.approx(sum(row[f"{key}_per_seed"]) / 2, abs=0.1)
        assert isinstance(row["vs_rlboost-plus_spans_1"], bool), name
    roll = data["systems"]["roll"]
    assert roll["vs_roll_ci95"] == [1.0, 1.0] and roll["vs_roll_spans_1"] is True
    rlb = data["systems"]["rlboost-plus"]
    ratios = [a / b for a, b in zip(rlb["tokens_per_s_per_seed"], roll["tokens_per_s_per_seed"], strict=True)]
    assert rlb["vs_roll"] == pytest.approx(sum(ratios) / 2, rel=1e-3)
    assert data["checks"]["oracle_upper_bound"]["ok"] is True
    table = cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY, "--seeds", "2")
    assert table.exit_code == 0 and "95% interval" in table.stdout and "spans 1" in table.stdout


def test_one_seed_keeps_the_single_run_figures_without_an_interval(cli):
    data = json.loads(cli("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "roll", *TINY,
                          "--json").stdout)
    assert data["tokens_per_s_ratio_of_sums"] >= data["tokens_per_s_window"] > 0
    assert "tokens_per_s_per_seed" not in data
    res = cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY, "--seeds", "0")
    assert res.exit_code == 2 and "--seeds" in res.output


def test_compare_table_names_every_system(cli):
    res = cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY)
    assert res.exit_code == 0
    for name in SYSTEMS:
        assert name in res.stdout
    assert "oracle >= every other system" in res.stdout


def test_plot_writes_a_png(cli, tmp_path: Path):
    png = tmp_path / "run.png"
    res = cli("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "rlboost-plus", *SHORT,
              "--plot", str(png), "--json")
    assert res.exit_code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = tmp_path / "compare.png"
    assert cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY, "--plot", str(both)).exit_code == 0
    assert both.stat().st_size > 10_000


@pytest.mark.parametrize(("args", "needle"), [
    (["--policy", "nope"], "known: roll, roll-large, rlboost-plus, pearl, oracle, pearl-pd-only"),
    (["--policy", "roll", "--set", "workload.batch_size=abc"], "workload.batch_size"),
    (["--policy", "roll", "--set", "workload.colour=red"], "workload.colour"),
    (["--policy", "roll", "--set", "cluster.reserved_rollout_gpus=3"], "cluster.reserved_rollout_gpus"),
    (["--policy", "roll", "--set", "nokey"], "--set"),
    (["--policy", "roll", "--plot", "/nonexistent/dir/x.png"], "--plot"),
    (["--policy", "roll", "--plot", "x.jpg"], "--plot"),
])
def test_bad_input_exits_2_naming_the_field(cli, args, needle, tmp_path):
    res = cli("sim", "run", "--scenario", "paper-qwen3-8b-seg1", *args)
    assert res.exit_code == 2
    assert needle in res.stderr
    assert res.stdout == ""


def test_tp_above_a_node_exits_2_naming_tp(cli):
    # 16 training and 16 rollout GPUs are whole workers of tp=16, but a worker does not span nodes of 8
    res = cli("sim", "run", "--scenario", "ablation-qwen3-8b-dedicated16", "--policy", "roll", "--set", "tp=16")
    assert res.exit_code == 2 and res.stdout == ""
    assert "tp (16) must be at most 8" in res.stderr


def test_a_missing_scenario_exits_2(cli, tmp_path):
    res = cli("sim", "compare", "--scenario", str(tmp_path / "none.yaml"))
    assert res.exit_code == 2 and "--scenario" in res.stderr


def test_the_installed_command_prints_json_only_on_stdout(tmp_path):
    exe = Path(sys.executable).with_name("pearlctl")
    proc = subprocess.run([str(exe), "sim", "run", "--scenario", "paper-qwen3-30b-a3b-seg3", "--policy", "roll",
                           *SHORT, "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert RUN_KEYS <= json.loads(proc.stdout).keys()


@pytest.mark.parametrize("policy", ["rlboost-plus", "pearl"])
def test_runs_are_identical_across_processes(tmp_path, cli, policy):
    """A run in another process, under another string-hash seed, reports exactly what this one does."""
    exe = Path(sys.executable).with_name("pearlctl")
    args = ["sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", policy, *SHORT, "--json"]
    ours = os.environ.get("PYTHONHASHSEED")  # unset or "random": this process hashes with a random key
    env = {**os.environ, "PYTHONHASHSEED": "2" if ours == "1" else "1"}
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    here = cli(*args)
    assert here.exit_code == 0, here.output
    outputs = [json.loads(proc.stdout), json.loads(here.stdout)]
    for data in outputs:
        data.pop("wall_s")
    assert outputs[0] == outputs[1]


def test_a_terminal_gets_a_progress_bar_per_system_that_reaches_the_end(cli, monkeypatch):
    import io
    import re

    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr("pearl.cli.sim.err", Console(file=screen, force_terminal=True, width=100))
    res = cli("sim", "compare", "--scenario", "paper-qwen3-8b-seg1", *TINY, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["systems"].keys() == SYSTEMS
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    last = dict(re.findall(r"([a-z-]+) [━╺╸ ]+ *(\d+)%", plain))  # each bar's latest state
    assert last == {name: "100" for name in SYSTEMS}


def test_progress_without_a_terminal_is_a_line_per_system(cli):
    res = cli("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "roll", *SHORT, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["policy"] == "roll"
    lines = res.stderr.splitlines()
    assert lines[0] == "simulating roll (1/1) over 1,200 simulated s ..."
    assert lines[1].startswith("roll done in ") and lines[1].endswith(" s (1/1)")


def test_compare_lists_every_system_from_the_start():
    """The bars of `sim compare`: every system has one before the first finishes (no silent minutes)."""
    import io

    from pearl.cli import sim as sim_cli
    from rich.console import Console

    names = ["roll", "roll-large", "rlboost-plus", "pearl", "oracle"]
    screen = io.StringIO()
    original = sim_cli.err
    sim_cli.err = Console(file=screen, force_terminal=True, width=100)
    try:
        with sim_cli._Bar(600.0, names) as bar:
            assert [bar.progress.tasks[i].description for i in range(5)] == names
            bar("roll", 300.0)
            assert bar.progress.tasks[0].completed == 300.0 and not bar.progress.tasks[1].started
            bar("roll", 600.0)
            bar("roll-large", 10.0)
            assert bar.progress.tasks[1].started
    finally:
        sim_cli.err = original
    lines = []
    with sim_cli._Bar(600.0, names, enabled=False) as bar:
        sim_cli.err, original = Console(file=io.StringIO(), width=200), sim_cli.err
        try:
            bar("roll", 0.0)
            bar("roll", 600.0)
            bar("pearl", 100.0)
            lines = sim_cli.err.file.getvalue().splitlines()
        finally:
            sim_cli.err = original
    assert lines[0] == "simulating roll (1/5) over 600 simulated s ..."
    assert lines[1].startswith("roll done in ") and lines[1].endswith("(1/5)")
    assert lines[2] == "simulating pearl (2/5) over 600 simulated s ..."


def test_a_system_without_rollout_gpus_says_so(cli):
    res = cli("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "roll", "--set", "duration_s=600",
              "--set", "cluster.reserved_rollout_gpus=0", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["tokens_per_s"] == 0
    assert "warning: roll: 0 tokens/s: cluster.reserved_rollout_gpus is 0, so it has no rollout GPU of its own" \
        in res.stderr


def test_a_worker_ended_by_the_abort_of_a_weight_update_is_not_paused(cli):
    """At a weight update that aborts (ROLL's), the abort can empty a draining worker, which then ends:
    the update pauses the workers that still have an engine and goes on (this setting ends one)."""
    res = cli("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "pearl-ungated", *TINY, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["training_steps"] >= 1 and data["reconfigurations"] > 0
