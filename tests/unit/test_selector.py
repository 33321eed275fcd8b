"""The PD selector: enumeration, ranking, infeasible candidates, hysteresis, forced switches."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Mode
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.predictor import SEARCH_GRID, Config, predict
from pearl.controlplane.core.profile import MODEL_ERROR, profile_from_workload
from pearl.controlplane.core.selector import _continuation, candidates_for, select
from pearl.controlplane.core.switching import RATIO_ERROR, SwitchCosts
from pearl.controlplane.errors import BadInput
from pearl.sim.scenario import load_scenario

pytestmark = pytest.mark.unit

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"
FREE = SwitchCosts(cold_start_s=0.0, admit_s=0.0, role_switch_s=0.0)


@pytest.fixture(scope="module")
def prior():
    cat = default_catalog()
    perf = PerfModel(cat.model("qwen3-8b"), cat.gpu("h800"), 2)
    return profile_from_workload(load_scenario(SCENARIOS / "ablation-qwen3-8b-dedicated16.yaml").workload, perf)


def test_candidates_are_colocated_and_every_split():
    assert [c.label for c in candidates_for(4)] == ["colocated", "1P3D", "2P2D", "3P1D"]
    assert [c.label for c in candidates_for(1)] == ["colocated"]
    assert candidates_for(0) == []


def test_ranking_is_by_predicted_makespan_with_infeasible_last(prior):
    small = replace(prior, engine=replace(prior.engine, kv_capacity_tokens=200_000))
    s = select(small, 8)
    assert len(s.candidates) == 8
    feasible = [c for c in s.candidates if c.feasible]
    infeasible = [c for c in s.candidates if not c.feasible]
    assert infeasible and all(c.reason for c in infeasible)
    assert s.candidates[: len(feasible)] == tuple(feasible)
    assert [c.predicted_s for c in feasible] == sorted(c.predicted_s for c in feasible)
    assert s.best == feasible[0].config and s.chosen == s.best
    assert s.forced and s.current is None and "nothing running" in s.reason
    # the chosen configuration's prediction agrees with the predictor
    assert s.prediction.makespan_s == pytest.approx(predict(small, s.chosen).makespan_s)


def test_close_candidates_keep_the_current_configuration(prior):
    s = select(prior, 8)
    runner_up = s.candidates[1]
    assert runner_up.feasible and runner_up.predicted_s < 1.05 * s.candidates[0].predicted_s
    kept = select(prior, 8, runner_up.config)
    assert kept.chosen == runner_up.config and not kept.switched and not kept.forced
    assert kept.decision is not None and not kept.decision.switch
    assert "keep" in kept.reason


def test_a_gain_beyond_the_threshold_switches(prior):
    s = select(prior, 8)
    worst = [c for c in s.candidates if c.feasible][-1]
    moved = select(prior, 8, worst.config, costs=FREE, horizon_s=3600.0)
    same_mode = next(c.config for c in s.candidates if c.feasible and c.config.mode is worst.config.mode)
    # the best overall, or the best of the same mode when its smaller margin leaves it more to spare
    assert moved.switched and moved.chosen in (s.best, same_mode)
    assert moved.decision.switch and moved.decision.gain_s > moved.decision.threshold_s


def test_mode_switch_needs_more_than_a_ratio_change(prior):
    """From a split far from the best, a cheap ratio change may pay where a mode switch does not."""
    s = select(prior, 8)
    splits = [c for c in s.candidates if c.feasible and c.config.mode is Mode.SPLIT]
    worst_split = splits[-1].config
    costly = SwitchCosts(cold_start_s=10_000.0, admit_s=1.0, role_switch_s=1.0)
    out = select(prior, 8, worst_split, costs=costly, horizon_s=3600.0)
    assert out.chosen.mode is Mode.SPLIT and out.chosen != worst_split
    assert out.chosen == splits[0].config


def test_infeasible_current_is_a_forced_switch(prior):
    small = replace(prior, engine=replace(prior.engine, kv_capacity_tokens=120_000))
    out = select(small, 8, Config.split(6, 2))  # its decode KV cannot hold the batch
    assert out.forced and out.switched and out.chosen == out.best
    assert "infeasible" in out.reason and out.decision is None


def test_budget_change_forces_the_count_but_hysteresis_guards_the_shape(prior):
    out = select(prior, 10, Config.split(2, 6))
    assert out.forced and out.chosen.workers == 10
    assert "2P6D continues as 2P8D" in out.reason  # the P:D ratio kept at the new count
    assert out.decision is not None
    assert out.chosen == (out.best if out.decision.switch else Config.split(2, 8))
    # with free actuators a mode switch still re-prefills the live contexts, plus the margin of two
    # modes that never ran (each the model's error alone)
    d = select(prior, 10, Config.split(2, 6), costs=FREE, horizon_s=3600.0).decision
    margin = math.sqrt(2) * MODEL_ERROR if d.cost_s > 0 else math.sqrt(2) * RATIO_ERROR
    assert 0 < d.cost_s < 10 and d.threshold_s == pytest.approx(d.cost_s + margin * d.work_s)


def test_nothing_to_choose(prior):
    assert select(prior, 0).chosen is None
    none_fit = replace(prior, engine=replace(prior.engine, kv_capacity_tokens=1000))
    out = select(none_fit, 4)
    assert out.chosen is None and "no feasible configuration" in out.reason
    with pytest.raises(BadInput, match="budget_workers"):
        select(prior, -1)
    with pytest.raises(BadInput, match="remaining_fraction"):
        select(prior, 4, remaining_fraction=0.0)


def test_explain_and_summary(prior):
    out = select(prior, 16, Config.split(4, 12))
    text = out.explain()
    assert "rank" in text and out.reason in text
    assert str(out.chosen) in text
    summary = json.loads(json.dumps(out.summary()))
    assert summary["chosen"] == out.chosen.label and summary["current"] == "4P12D"
    assert len(summary["candidates"]) == 10
    assert {"S", "dL", "r", "A", "b", "t_p", "theta"} <= set(summary["symbols"])
    assert all(c["paper_s"] > 0 for c in summary["candidates"])


def test_selection_is_deterministic(prior):
    a, b = select(prior, 12, Config.colocated(12)), select(prior, 12, Config.colocated(12))
    assert a.chosen == b.chosen and a.candidates == b.candidates


def test_current_config_of_a_fleet():
    from pearl.controlplane.core.domain import Activity, Role, WorkerZone
    from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot
    from pearl.controlplane.core.selector import current_config

    def slot(i, role, activity=Activity.ACTIVE):
        return WorkerSlot(i, "n0", (i,), WorkerZone.DEDICATED, role, activity)

    split = FleetSnapshot(1, (slot(0, Role.PREFILL), slot(1, Role.DECODE), slot(2, Role.DECODE, Activity.TRANSITIONING),
                              slot(3, Role.COLOCATED, Activity.INACTIVE)))  # fmt: skip
    assert current_config(split) == Config.split(1, 2)
    assert current_config(FleetSnapshot(1, (slot(0, Role.COLOCATED),))) == Config.colocated(1)
    assert current_config(FleetSnapshot(1, ())) is None


# -- properties ------------------------------------------------------------------------------------


def _profiles():
    cat = default_catalog()
    perf = PerfModel(cat.model("qwen3-8b"), cat.gpu("h800"), 2)
    paper = profile_from_workload(load_scenario(SCENARIOS / "ablation-qwen3-8b-dedicated16.yaml").workload, perf)
    heavy = profile_from_workload(load_scenario(SCENARIOS / "prefill-heavy-qwen3-8b-dedicated16.yaml").workload, perf)
    # a small KV cache: splits with few decode workers become infeasible
    return (paper, heavy, replace(paper, engine=replace(paper.engine, kv_capacity_tokens=200_000)))


PROFILES = _profiles()


@st.composite
def configs(draw):
    n = draw(st.integers(1, 14))
    if n == 1 or draw(st.booleans()):
        return Config.colocated(n)
    p = draw(st.integers(1, n - 1))
    return Config.split(p, n - p)


@st.composite
def switch_costs(draw):
    seconds = st.floats(0.0, 300.0)
    return SwitchCosts(draw(seconds), draw(seconds), draw(seconds), draw(seconds))


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(range(len(PROFILES))),
    st.integers(1, 12),
    st.none() | configs(),
    switch_costs(),
    st.floats(0.0, 7200.0),
    st.sampled_from([1.0, 0.6, 0.2]),
)
def test_selection_properties(which, budget, current, costs, horizon_s, remaining):
    profile = PROFILES[which]
    s = select(profile, budget, current, costs=costs, horizon_s=horizon_s, remaining_fraction=remaining)
    # every candidate of the budget, once: feasible first, by predicted makespan
    assert sorted(c.config for c in s.candidates) == sorted(candidates_for(budget))
    feasible = [c for c in s.candidates if c.feasible]
    assert s.candidates[: len(feasible)] == tuple(feasible)
    assert [c.predicted_s for c in feasible] == sorted(c.predicted_s for c in feasible)
    assert all(c.reason for c in s.candidates[len(feasible):])
    if not feasible:
        assert s.chosen is None and s.best is None
        return
    assert s.best == feasible[0].config
    assert s.chosen in {c.config for c in feasible} and s.chosen.workers == budget
    reference = _continuation(current, budget) if current is not None else None
    if reference is None or reference not in {c.config for c in feasible}:
        # a forced switch is never blocked: nothing running, or the current shape cannot stay
        assert s.forced and s.chosen == s.best and s.decision is None
        return
    assert s.forced == (reference != current)
    if s.chosen != reference:
        # a switch only when the predicted gain beats the threshold derived from the switch cost
        assert s.decision is not None and s.decision.switch and s.decision.gain_s > s.decision.threshold_s
        # cheaper actuators never keep a configuration that dearer ones left
        free = select(profile, budget, current, costs=FREE, horizon_s=horizon_s, remaining_fraction=remaining)
        assert free.chosen != reference
    elif reference != s.best:
        assert s.decision is not None and not s.decision.switch  # kept by hysteresis, with the numbers


# -- the searched ranking --------------------------------------------------------------------------


def _search_profiles():
    """Lock-step and asynchronous batches; a prefill-heavy workload (its screen has a plateau far
    from the best); a small KV cache (splits with few decode workers infeasible)."""
    cat = default_catalog()
    perf = PerfModel(cat.model("qwen3-8b"), cat.gpu("h800"), 2)
    out = []
    for name in ("paper-qwen3-8b-seg1.yaml", "prefill-heavy-qwen3-8b-dedicated16.yaml"):
        sc = load_scenario(SCENARIOS / name)
        for rollout in (None, sc.training.rollout()):
            out.append(profile_from_workload(sc.workload, perf, rollout=rollout))
    small = replace(out[0], engine=replace(out[0].engine, kv_capacity_tokens=120_000))
    return (*out, small, replace(small, rollout=out[1].rollout))


SEARCH_PROFILES = _search_profiles()


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(range(len(SEARCH_PROFILES))),
    st.integers(2 * SEARCH_GRID + 1, 700),
    st.sampled_from(["none", "colocated", "quarter", "one", "most"]),
    switch_costs(),
    st.floats(0.0, 7200.0),
    st.sampled_from([1.0, 0.6, 0.2]),
)
def test_the_search_chooses_what_the_exhaustive_ranking_chooses(which, budget, shape, costs, horizon_s, remaining):
    profile = SEARCH_PROFILES[which]
    n = budget
    current = {"none": None, "colocated": Config.colocated(n), "quarter": Config.split(n // 4, n - n // 4),
               "one": Config.split(1, n - 1), "most": Config.split(n - 2, 2)}[shape]
    kw = {"costs": costs, "horizon_s": horizon_s, "remaining_fraction": remaining}
    searched = select(profile, n, current, **kw)
    every = select(profile, n, current, exhaustive=True, **kw)
    assert (searched.chosen, searched.best, searched.forced, searched.reason) == (
        every.chosen, every.best, every.forced, every.reason)
    # what the search evaluated it evaluated as the exhaustive ranking did (to the last bits of a
    # matrix product over a different number of columns), and far fewer of them
    exhaustive = {c.config: c for c in every.candidates}
    for c in searched.candidates:
        e = exhaustive[c.config]
        assert (c.feasible, c.reason, c.refined) == (e.feasible, e.reason, e.refined)
        assert c.predicted_s == pytest.approx(e.predicted_s, rel=1e-9) and c.paper_s == pytest.approx(e.paper_s)
    assert searched.prediction.makespan_s == pytest.approx(every.prediction.makespan_s, rel=1e-9)
    assert len(searched.candidates) < len(every.candidates) / 2


def test_the_search_at_4096_gpus_evaluates_few_splits_and_the_current_one():
    profile = SEARCH_PROFILES[1]
    current = Config.split(384, 1152)
    s = select(profile, 2048, current, horizon_s=3600.0)
    assert s.chosen == select(profile, 2048, current, horizon_s=3600.0, exhaustive=True).chosen
    assert len(s.candidates) <= 4 * SEARCH_GRID
    assert Config.split(512, 1536) in {c.config for c in s.candidates}  # the current shape at the new count
