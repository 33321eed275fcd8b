"""Sampling a rollout step's trajectories: deterministic, GRPO groups, truncation at the context cap."""

from __future__ import annotations

import numpy as np
import pytest
from pearl.controlplane.core.telemetry import StepTelemetry
from pearl.sim.scenario import load_scenario
from pearl.sim.trajectories import sample_batch

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def workload():
    return load_scenario("paper-qwen3-8b-seg1").workload


def _plan(batch):
    return [(t.id, t.group, t.prompt, t.gen, t.obs, t.env_s, t.truncated) for t in batch]


def test_a_batch_is_a_function_of_seed_and_step(workload):
    assert _plan(sample_batch(workload, 1, 3)) == _plan(sample_batch(workload, 1, 3))
    assert _plan(sample_batch(workload, 1, 3)) != _plan(sample_batch(workload, 1, 4))
    assert _plan(sample_batch(workload, 1, 3)) != _plan(sample_batch(workload, 2, 3))


def test_ids_and_groups_are_unique_over_the_run(workload):
    a, b = sample_batch(workload, 1, 0), sample_batch(workload, 1, 1)
    assert len({t.id for t in a + b}) == 2 * workload.batch_size
    assert not {t.group for t in a} & {t.group for t in b}


def test_group_members_share_their_prompt(workload):
    batch = sample_batch(workload, 1, 0)
    groups: dict[int, set[int]] = {}
    for t in batch:
        groups.setdefault(t.group, set()).add(t.prompt)
    assert len(groups) == workload.batch_size // workload.group_size
    assert all(len(prompts) == 1 for prompts in groups.values())
    assert len({next(iter(p)) for p in groups.values()}) > 1


def test_contexts_stay_within_the_cap_and_truncated_ones_reach_it(workload):
    cap = workload.max_context_tokens
    truncated = 0
    for step in range(5):
        for t in sample_batch(workload, 1, step):
            assert len(t.obs) == len(t.env_s) == t.turns - 1
            assert t.total_tokens <= cap
            assert all(g >= 1 for g in t.gen[:-1])
            truncated += t.truncated
    assert truncated > 0  # the paper workload hits the 32k cap for its longest trajectories


@pytest.mark.parametrize(("cap", "gen", "obs"), [
    (4000, [600, 100], [300]),  # the second turn generates until the context is full
    (3850, [600], []),  # the first observation would not fit: it ends after one turn
])
def test_truncation_at_the_cap(cap, gen, obs):
    w = load_scenario("paper-qwen3-8b-seg1", [
        f"workload.max_context_tokens={cap}", "workload.prompt_tokens={dist: constant, value: 3000}",
        "workload.gen_tokens_per_turn={dist: constant, value: 600}",
        "workload.obs_tokens_per_turn={dist: constant, value: 300}", "workload.turns={dist: constant, value: 10}",
    ]).workload
    t = sample_batch(w, 1, 0)[0]
    assert (t.gen, t.obs, t.truncated) == (gen, obs, True)


def test_without_the_cap_every_turn_is_played():
    w = load_scenario("paper-qwen3-8b-seg1", [
        "workload.prompt_tokens={dist: constant, value: 100}", "workload.turns={dist: constant, value: 3}",
        "workload.gen_tokens_per_turn={dist: constant, value: 10}",
        "workload.obs_tokens_per_turn={dist: constant, value: 5}"]).workload
    t = sample_batch(w, 1, 0)[0]
    assert (t.gen, t.obs, t.truncated, t.total_tokens) == ([10, 10, 10], [5, 5], False, 140)


def test_records_validate_as_telemetry(workload):
    batch = sample_batch(workload, 1, 0)
    tel = StepTelemetry(step=0, batch_size=len(batch), trajectories=[t.record() for t in batch])
    assert sum(r.total_tokens for r in tel.trajectories) == sum(t.total_tokens for t in batch)
    assert all(t.metric_tokens == t.generated_tokens + t.total_tokens for t in batch)


def test_turns_tokens_and_environment_waits_follow_the_scenarios_distributions():
    w = load_scenario("paper-qwen3-8b-seg1", ["workload.max_context_tokens=100000000"]).workload  # no truncation
    batch = [t for step in range(40) for t in sample_batch(w, 1, step)]
    turns = np.array([t.turns for t in batch])
    env = np.concatenate([t.env_s for t in batch])
    gen = np.concatenate([t.gen for t in batch])
    obs = np.concatenate([t.obs for t in batch])
    # whole turns and tokens: a cap is reached rounded to the nearest whole one
    assert np.median(turns) == pytest.approx(w.turns.median, rel=0.1) and turns.max() <= round(w.turns.max)
    assert env.max() <= w.env_latency_s.max and gen.max() <= round(w.gen_tokens_per_turn.max)
    for sampled, dist in ((env, w.env_latency_s), (gen, w.gen_tokens_per_turn), (obs, w.obs_tokens_per_turn)):
        assert np.median(sampled) == pytest.approx(dist.quantile(0.5), rel=0.05)
        assert np.quantile(sampled, 0.99) == pytest.approx(dist.quantile(0.99), rel=0.1)  # the cap, if below
    other = load_scenario("paper-qwen3-8b-seg1", [
        "workload.env_latency_s={dist: empirical, values: [0.5, 7]}", "workload.turns={dist: uniform, low: 2, high: 4}",
    ]).workload
    batch = [t for step in range(4) for t in sample_batch(other, 1, step)]
    assert {e for t in batch for e in t.env_s} == {0.5, 7.0}
    assert {t.turns for t in batch if not t.truncated} <= {2, 3, 4}
