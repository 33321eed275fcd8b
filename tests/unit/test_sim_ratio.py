"""`sim ratio` (the paper's Table 2): the JSON contract, a selection that comes from the predictor
alone, the gap, the candidates, determinism, bad input, and the prefill telemetry the profile is
fitted from."""

from __future__ import annotations

import inspect
import json

import pytest
from pearl.cli.app import app
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Mode, Role
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.predictor import Config
from pearl.controlplane.core.selector import select
from pearl.controlplane.core.tracker import fit_profile
from pearl.controlplane.errors import BadInput
from pearl.policies.baselines import StaticSplit
from pearl.sim import ratio as ratio_module
from pearl.sim.engine import Engine, EngineTiming, Request
from pearl.sim.ratio import (
    budget_workers,
    fit_from_run,
    prior_profile,
    ratio,
    run_static,
    select_config,
    with_workers,
)
from pearl.sim.runner import Simulation
from pearl.sim.scenario import load_scenario
from pearl.sim.systems import system
from pearl.sim.trajectories import Trajectory
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

SCENARIO = "ablation-qwen3-8b-dedicated10"
SMALL = ["duration_s=1800", "workload.batch_size=16"]  # 5 workers (13 with overlap), a few steps each
TINY = [*SMALL, "cluster.reserved_rollout_gpus=6", "cluster.training_gpus=4"]  # 3 workers (5 with overlap)
CONTRACT = {"selected", "empirical_best", "gap", "candidates"}


@pytest.fixture(scope="module")
def small():
    return ratio(load_scenario(SCENARIO, SMALL))


@pytest.fixture
def cli():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def _labels(n: int) -> list[str]:
    return ["colocated"] + [f"{p}P{n - p}D" for p in range(1, n)]


# -- the result ---------------------------------------------------------------------------------------


def test_candidates_are_colocated_and_every_split_of_the_budget(small):
    data = small.as_dict()
    assert data["budget_workers"] == 5 and data["budget_gpus"] == 10
    assert [c["config"] for c in data["candidates"]] == _labels(5)
    for c in data["candidates"]:
        assert c["predicted_s"] > 0 and c["simulated_s"] > 0 and c["paper_s"] > 0
    # every candidate measured on the same batches: the steps after the warm-up, as many as the profile's
    assert data["measured_steps"] == data["profile_steps"] >= 1
    assert all(len(c.makespans) == small.steps for c in small.candidates)


def test_overlap_adds_every_training_gpu_to_the_budget():
    sc = load_scenario(SCENARIO, TINY)
    assert budget_workers(sc, False) == 3 and budget_workers(sc, True) == 5
    data = ratio(sc, True).as_dict()
    assert data["overlap"] is True and data["budget_gpus"] == 10
    assert [c["config"] for c in data["candidates"]] == _labels(5)


def test_the_fixed_budget_ignores_preemptible_gpus():
    sc = load_scenario("paper-qwen3-8b-seg1")
    assert sc.cluster.preemptible is not None
    fixed = with_workers(sc, 3)
    assert fixed.cluster.preemptible is None and fixed.trace_data is None
    assert fixed.cluster.reserved_rollout_gpus == 3 * sc.tp


def test_empirical_best_and_gap_follow_the_simulated_makespans(small):
    data = small.as_dict()
    simulated = {c["config"]: c["simulated_s"] for c in data["candidates"]}
    assert data["empirical_best"] == min(simulated, key=simulated.get)
    exact = {c.config.label: c.simulated_s for c in small.candidates}
    expected = exact[data["selected"]] / exact[data["empirical_best"]] - 1
    assert data["gap"] == pytest.approx(expected, abs=1e-5)
    assert data["gap"] >= 0


def test_simulated_is_the_mean_of_the_measured_steps_after_the_warm_up():
    sc = load_scenario(SCENARIO, SMALL)
    result = ratio(sc, steps=2, warmup=1)
    run = run_static(with_workers(sc, 5), Config.split(2, 3), stop_after=3)
    assert len(run.makespans) == 3  # it stopped once the steps were finished
    row = next(c for c in result.candidates if c.config == Config.split(2, 3))
    assert row.makespans == run.makespans[1:3]
    assert row.simulated_s == pytest.approx(sum(run.makespans[1:3]) / 2)


def test_a_static_split_stays_at_its_ratio():
    sc = with_workers(load_scenario(SCENARIO, SMALL), 5)
    sim = Simulation(sc, StaticSplit(2))
    sim.run()
    roles = [w.role for w in sim.cluster.workers if w.engine is not None]
    assert roles.count(Role.PREFILL) == 2 and roles.count(Role.DECODE) == 3
    assert sim.plans == 0 and sim.reconfigurations == 0  # installed at t=0, never changed


# -- the selection comes from the predictor alone ----------------------------------------------------


def test_selection_reads_the_profile_and_the_budget_only():
    assert list(inspect.signature(select_config).parameters) == ["profile", "workers"]


def test_selection_is_unchanged_when_the_simulated_makespans_are_perturbed(monkeypatch, small):
    real = ratio_module._simulate

    def reversed_ranking(args):
        scenario, config, stop_after = args
        makespans, wall = real(args)
        # colocated becomes the slowest, the largest prefill pool the fastest
        factor = 3.0 if config.n_colocated else 0.1 ** config.n_prefill
        return tuple(m * factor for m in makespans), wall

    monkeypatch.setattr(ratio_module, "_simulate", reversed_ranking)
    perturbed = ratio(load_scenario(SCENARIO, SMALL))
    assert perturbed.as_dict()["selected"] == small.as_dict()["selected"]
    assert [c.predicted_s for c in perturbed.candidates] == [c.predicted_s for c in small.candidates]
    assert perturbed.empirical_best == Config.split(4, 1) != perturbed.selected
    expected = perturbed.simulated(perturbed.selected) / perturbed.simulated(perturbed.empirical_best) - 1
    assert perturbed.gap == pytest.approx(expected) and perturbed.gap > 0


def test_selected_is_the_predictors_best_feasible_candidate_with_the_fitted_profile():
    sc = load_scenario(SCENARIO, SMALL)
    result = ratio(sc)
    profiling = run_static(sc, result.profile_config)
    profile = fit_from_run(prior_profile(sc), profiling)
    assert profile.steps_observed == len(profiling.makespans) - 1 == result.profile_steps
    selection = select(profile, 5)
    feasible = [c for c in selection.candidates if c.feasible]
    best = min(feasible, key=lambda c: c.predicted_s)
    assert result.selected == selection.chosen == best.config
    assert {c.config: c.predicted_s for c in result.candidates} == {
        c.config: c.predicted_s for c in selection.candidates}


def test_the_profiling_run_is_no_candidate_by_default(small):
    assert small.profile_config == Config.colocated(4)
    assert small.profile_config not in [c.config for c in small.candidates]
    chosen = ratio(load_scenario(SCENARIO, SMALL), profile_workers=5)
    assert chosen.profile_config == Config.colocated(5)


# -- determinism ---------------------------------------------------------------------------------------


def _without_wall(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "wall_s"}


def test_deterministic_and_identical_over_processes():
    sc = load_scenario(SCENARIO, TINY)
    one = _without_wall(ratio(sc, True, jobs=1).as_dict())
    assert one == _without_wall(ratio(sc, True, jobs=1).as_dict())
    assert one == _without_wall(ratio(sc, True, jobs=2).as_dict())


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"steps": 0}, "steps"), ({"warmup": -1}, "warmup"), ({"profile_workers": 0}, "profile_workers"),
     ({"jobs": -1}, "jobs")],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(BadInput, match=field):
        ratio(load_scenario(SCENARIO, TINY), **kwargs)


def test_cli_bad_input_exits_2_naming_the_field(cli):
    cases = [
        (["--steps", "0"], "steps"),
        (["--profile-workers", "0"], "profile_workers"),
        (["--set", "cluster.reserved_rollout_gpus=0"], "cluster.reserved_rollout_gpus"),
        (["--set", "duration_s=60"], "duration_s"),
        (["--set", "workload.batch_size=-3"], "workload.batch_size"),
    ]
    for extra, field in cases:
        res = cli("sim", "ratio", "--scenario", SCENARIO, *[a for kv in SMALL for a in ("--set", kv)], *extra,
                  "--json")
        assert res.exit_code == 2, (extra, res.output)
        assert field in res.output, (extra, res.output)
        error = json.loads(res.stdout)  # with --json, stdout holds the error as one JSON object
        assert error["exit"] == 2 and field in error["error"]
    missing = cli("sim", "ratio", "--scenario", "no-such-scenario.yaml", "--json")
    assert missing.exit_code == 2 and "--scenario" in missing.output


# -- the CLI -------------------------------------------------------------------------------------------


def test_cli_json_is_one_object_with_the_contract_keys(cli):
    res = cli("sim", "ratio", "--scenario", SCENARIO, *[a for kv in TINY for a in ("--set", kv)], "--overlap",
              "--jobs", "1", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert CONTRACT <= data.keys()
    assert isinstance(data["selected"], str) and isinstance(data["empirical_best"], str)
    assert isinstance(data["gap"], float) and data["gap"] >= 0
    assert isinstance(data["candidates"], list) and len(data["candidates"]) == 5
    for c in data["candidates"]:
        assert {"config", "predicted_s", "simulated_s"} <= c.keys()
        assert isinstance(c["config"], str)
        assert isinstance(c["predicted_s"], float) and isinstance(c["simulated_s"], float)
    assert data["selected"] in [c["config"] for c in data["candidates"]]
    assert isinstance(data["mape"], float) and isinstance(data["profile_steps"], int)


def test_cli_table_marks_the_selected_and_the_best(cli):
    # a longer run: the profiling fleet (2 workers) needs two rollout steps of the paper workload
    res = cli("sim", "ratio", "--scenario", SCENARIO, *[a for kv in TINY for a in ("--set", kv)],
              "--set", "duration_s=3600", "--jobs", "1")
    assert res.exit_code == 0, res.output
    assert "selected" in res.stdout and "best" in res.stdout
    for label in _labels(3):
        assert label in res.stdout


# -- the telemetry the profile is fitted from ------------------------------------------------------------

PERF = PerfModel(default_catalog().model("qwen3-8b"), default_catalog().gpu("h800"), 2)
TIMING = EngineTiming(PERF)


def _drain(engine: Engine) -> None:
    while engine.busy_until is not None:
        engine.wake(engine.busy_until)


def test_prefill_records_carry_no_decode_batch_and_the_context_before_them():
    engine = Engine(0, Role.COLOCATED, TIMING, PERF.kv_capacity_tokens, sink=[])
    long_turn = Trajectory(0, 0, 0, 1000, [2000], [], [], False)
    engine.submit(Request(long_turn, 1), 0.0)
    engine.wake(engine.busy_until)  # prefilled; decoding
    assert engine.batch == 1
    arriving = Trajectory(1, 0, 1, 20_000, [10], [], [], False)  # chunked: 8192, 8192, 3616
    engine.submit(Request(arriving, 2), engine.t0 + 0.01)
    _drain(engine)
    prefills = [r for r in engine.sink if r[4] > 0]
    assert [(r[2], r[3], r[4]) for r in prefills] == [(0, 0.0, 1000), (0, 0.0, 8192), (0, 8192.0, 8192),
                                                      (0, 16384.0, 20_000 - 16384)]
    # the next turn prefills only what is new, after the cached context
    traj = Trajectory(2, 0, 2, 3000, [100, 50], [500], [1.0], False)
    engine.submit(Request(traj, 3), 1e3)
    _drain(engine)
    traj.context += 100 + 500
    traj.turn, traj.turn_generated = 1, 0
    engine.submit(Request(traj, 4), 2e3)
    _drain(engine)
    # the prompt and the frozen TURN_PREFIX_REUSE of the rest of the cached 3,100 tokens are reused; the
    # rest of the 3,600 is prefilled after them
    from pearl.controlplane.core import perfmodel

    reused = int(perfmodel.reusable_prefix(3100, 3000, perfmodel.TURN_PREFIX_REUSE))
    assert 3000 <= reused < 3100
    assert [(r[2], r[3], r[4]) for r in engine.sink if r[4] > 0][-1] == (0, float(reused), 3600 - reused)


def test_the_prefill_refit_from_simulated_telemetry_stays_near_the_catalog():
    sc = load_scenario(SCENARIO, ["duration_s=1800"])
    run = run_static(sc, Config.colocated(5))
    profile = prior_profile(sc)
    ratios = []
    for telemetry in run.telemetry:
        profile = fit_profile(profile, telemetry)
        ratios.append(profile.fit["prefill_ratio"])
    # the simulator's prefill is the catalog's model: measured / predicted stays close to 1 (chunk
    # sizes other than the catalog's 2048 tokens move it a little)
    assert all(0.85 < r < 1.2 for r in ratios), ratios
    assert 0.9 < profile.engine.prefill_s_per_token / prior_profile(sc).engine.prefill_s_per_token < 1.2


# -- a workload where splitting wins ------------------------------------------------------------------

PREFILL_HEAVY = "prefill-heavy-qwen3-8b-dedicated16"


@pytest.mark.xfail(strict=True, reason=(
    "docs/fidelity.md, 'What the fit cannot reach' (Fig. 2c): with the engine calibrated on the paper's "
    "§3 this workload's short turns keep colocation ahead (4P4D ~18 s against ~11 s per step) and the "
    "predictor selects it"))
def test_on_a_prefill_heavy_workload_a_split_is_predicted_simulated_and_run_by_pearl():
    """The shipped counter-example to the paper scenarios: short replies after long tool observations.
    The predictor prefers 4P4D over colocated, the simulator agrees on the same batches, and pearl
    installs a split."""
    sc = load_scenario(PREFILL_HEAVY, ["duration_s=120"])
    workers = budget_workers(sc, False)
    assert workers == 8
    chosen = select_config(prior_profile(sc), workers).chosen
    assert chosen.label != "colocated" and 3 <= chosen.n_prefill <= 5
    split = run_static(sc, Config.split(4, 4), stop_after=6)
    colocated = run_static(sc, Config.colocated(8), stop_after=6)
    steps = min(len(split.makespans), len(colocated.makespans))
    assert steps >= 4
    assert sum(split.makespans[1:steps]) < sum(colocated.makespans[1:steps])
    pearl = Simulation(sc, system("pearl").policy(sc))
    pearl.run()
    roles = [w.role for w in pearl.cluster.workers if w.engine is not None]
    assert Role.PREFILL in roles and Role.DECODE in roles


# -- the paper's six Table-2 settings (slow: minutes of simulation; `pytest -m slow`) ---------------------


# docs/fidelity.md, Table 2: the simulated best split of each setting
# (at 16 with the training GPUs, 4P12D, 5P11D and 3P13D lie within 0.3% of each other: which one is
# best follows the workers each role lands on, the orchestrator's choice)
TABLE2_BEST = {(10, False): "2P3D", (10, True): "3P10D", (12, False): "2P4D", (12, True): "3P11D",
               (16, False): "2P6D", (16, True): "4P12D"}


@pytest.fixture(scope="module")
def table2():
    return {
        (gpus, overlap): ratio(load_scenario(f"ablation-qwen3-8b-dedicated{gpus}"), overlap, jobs=0)
        for gpus in (10, 12, 16)
        for overlap in (False, True)
    }


@pytest.mark.slow
@pytest.mark.xdist_group("table2")  # one worker computes the six settings for both tests
def test_table2_selected_is_within_one_percent_of_the_empirical_best_in_five_of_six(table2):
    """The paper's Table 2 bar: the selected configuration within 1% of the simulated best in at least
    five of the six settings (the paper's own: five of six, its miss 0.4%)."""
    gaps = {key: r.gap for key, r in table2.items()}
    assert sum(gap is not None and gap <= 0.01 for gap in gaps.values()) >= 5, gaps
    assert all(r.selected is not None and r.selected.mode is Mode.SPLIT for r in table2.values())


@pytest.mark.slow
@pytest.mark.xdist_group("table2")
def test_table2_as_reported_the_best_splits_the_gaps_and_the_predictors_error(table2):
    """What docs/fidelity.md reports of Table 2: the simulated best split of each setting, the selection
    within 1% of it in all six (five exactly the best), and the predictor's error per mode under 5% in
    every setting, 3% on average, well below the paper's formulas."""
    assert {key: r.empirical_best.label for key, r in table2.items()} == TABLE2_BEST
    gaps = {key: r.gap for key, r in table2.items()}
    assert all(gap is not None and gap <= 0.01 for gap in gaps.values()), gaps
    assert sum(r.selected == r.empirical_best for r in table2.values()) >= 5
    for mode in Mode:
        errors = [r.mape(mode=mode) for r in table2.values()]
        assert max(errors) < 0.05 and sum(errors) / len(errors) < 0.03, (mode, errors)
    assert all(r.mape() < r.mape(paper=True) / 3 for r in table2.values())
