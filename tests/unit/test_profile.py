"""The profile: engine prior from the performance model, workload pools, sample, symbols, JSON."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pearl.controlplane.core import perfmodel
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.profile import (
    DECODE_BATCHES,
    Provenance,
    WorkloadPools,
    draw_trajectories,
    engine_from_perf,
    expected_max,
    pools_from_workload,
    profile_from_dict,
    profile_from_workload,
    profile_to_dict,
    quantile_pool,
)
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.errors import BadInput
from pearl.sim.scenario import load_scenario

pytestmark = pytest.mark.unit

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"
# A reference SWE workload (the shipped paper scenario's shape before its round-2 fit), pinned here so
# that these tests of the mechanisms do not move with the calibration (docs/fidelity.md).
REFERENCE_WORKLOAD = ["workload.turns={dist: lognormal, median: 16, p99: 80, max: 100}",
                      "workload.gen_tokens_per_turn={dist: lognormal, median: 350, p99: 3000}",
                      "workload.obs_tokens_per_turn={dist: lognormal, median: 250, p99: 2500}",
                      "workload.env_latency_s={dist: lognormal, median: 1.5, p99: 60}"]


@pytest.fixture(scope="module")
def perf() -> PerfModel:
    cat = default_catalog()
    return PerfModel(cat.model("qwen3-8b"), cat.gpu("h800"), 2)


@pytest.fixture(scope="module")
def paper_workload() -> Workload:
    return load_scenario(SCENARIOS / "paper-qwen3-8b-seg1.yaml", REFERENCE_WORKLOAD).workload


@pytest.fixture(scope="module")
def prior(paper_workload, perf):
    return profile_from_workload(paper_workload, perf)


def test_engine_prior_reproduces_the_performance_model(perf):
    e = engine_from_perf(perf)
    for batch in (1, 8, 64):
        for ctx in (0.0, 4096.0, 30000.0):
            assert float(e.decode_iteration_s(batch, ctx)) == pytest.approx(perf.decode_step_time(batch, ctx), rel=1e-9)
    # between table points the curve is interpolated: within 3% of the model for a dense model
    assert float(e.decode_iteration_s(24, 8000.0)) == pytest.approx(perf.decode_step_time(24, 8000.0), rel=0.03)
    for ctx in (0.0, 16384.0):
        assert float(e.prefill_s_per_token_at(ctx)) == pytest.approx(perf.prefill_seconds_per_token(2048, ctx))
    assert float(e.kv_transfer_s(10_000)) == pytest.approx(perf.kv_transfer_time(10_000))
    assert e.kv_capacity_tokens == perf.kv_capacity_tokens
    assert e.decode_batches == DECODE_BATCHES


def test_a_b_is_the_secant_of_the_decode_curve(perf):
    e = engine_from_perf(perf)
    a, b = e.a_b(10_000.0, 16)
    assert a + b * 8 == pytest.approx(perf.decode_step_time(8, 10_000.0))
    assert a + b * 32 == pytest.approx(perf.decode_step_time(32, 10_000.0))
    assert 0 < b < a


def test_a_b_keeps_a_non_negative_on_a_convex_curve(perf):
    # a noisy or convex measured curve (a steep rise past the lower batch) must not give A < 0
    convex = replace(engine_from_perf(perf), decode_batches=(1, 4, 16, 64), decode_base_s=(0.004, 0.0041, 0.03, 0.2),
                     decode_s_per_ctx_token=0.0)
    a, b = convex.a_b(0.0, 8)
    assert a == 0.0 and b == pytest.approx(0.0041 / 4)
    assert a + b * 4 == pytest.approx(float(convex.decode_iteration_s(4, 0.0)))


def test_pools_are_the_distributions_quantiles(paper_workload):
    pools = pools_from_workload(paper_workload, n=101)
    assert pools.levels[50] == pytest.approx(0.5)
    assert pools.turns[50] == pytest.approx(16.0)  # the median
    assert pools.gen_tokens[50] == pytest.approx(350.0)
    assert max(pools.turns) <= 100  # the cap of the turn distribution
    for pool in (pools.prompt_tokens, pools.turns, pools.gen_tokens, pools.obs_tokens, pools.env_s):
        assert list(pool) == sorted(pool)
    # the far tail is kept: the top level is one in 10^5, where a 60 s-p99 lognormal reaches minutes
    assert 1 - pools.levels[-1] < 1e-5
    assert pools.env_s[-1] == pytest.approx(paper_workload.env_latency_s.quantile(pools.levels[-1]))
    assert pools.env_s[-1] > 150


def test_quantile_pool_of_weighted_values():
    uniform = (np.arange(4) + 0.5) / 4
    assert quantile_pool([1, 2, 3, 4], uniform) == (1.0, 2.0, 3.0, 4.0)
    heavy = quantile_pool([0.0, 10.0], (np.arange(10) + 0.5) / 10, weights=[9, 1])
    assert heavy == (0.0,) * 9 + (10.0,)  # discrete values stay discrete, in proportion


def test_sample_applies_the_context_cap_like_the_simulator(paper_workload):
    cap = paper_workload.max_context_tokens
    s = draw_trajectories(pools_from_workload(paper_workload), cap, 4000)
    start = s.prompt[:, None] + np.cumsum(s.gen + s.obs, axis=1) - s.gen - s.obs
    runs = s.gen > 0
    assert np.all((start + s.gen)[runs] <= cap)  # no turn generates past the cap
    assert np.all(s.gen.sum(axis=1) > 0) and np.all(runs.sum(axis=1) == s.turns)
    last = s.turns - 1
    assert np.all(s.env[np.arange(len(s.turns)), last] == 0)  # no environment after the last turn
    assert np.all(s.obs[np.arange(len(s.turns)), last] == 0)
    # the same workload through the simulator's sampler: same truncation rate and turns, within noise
    from pearl.sim.trajectories import sample_batch

    sim = [t for step in range(40) for t in sample_batch(paper_workload, seed=3, step=step)]
    assert s.truncated.mean() == pytest.approx(np.mean([t.truncated for t in sim]), abs=0.05)
    assert s.turns.mean() == pytest.approx(np.mean([t.turns for t in sim]), rel=0.05)


def test_sample_is_deterministic(prior):
    a = draw_trajectories(prior.workload, prior.max_context_tokens, 100)
    b = draw_trajectories(prior.workload, prior.max_context_tokens, 100)
    assert np.array_equal(a.gen, b.gen) and np.array_equal(a.env, b.env)


def test_expected_max():
    v = np.arange(1, 101, dtype=float)
    assert expected_max(v, 1) == pytest.approx(v.mean())
    assert expected_max(v, 10_000) == pytest.approx(100.0, abs=1e-3)
    rng = np.random.default_rng(0)
    draws = rng.choice(v, size=(20_000, 8)).max(axis=1).mean()
    assert expected_max(v, 8) == pytest.approx(draws, rel=0.01)


def test_symbols_of_the_paper_workload(prior, paper_workload):
    sym = prior.symbols()
    # S: the slowest of 64 trajectories (turns: median 16, p99 80); the 32k context cap at ~0.9k
    # tokens a turn bounds it below the cap of 100
    assert 30 < sym["S"] < 50
    assert sym["S"] == pytest.approx(expected_max(prior.sample.turns, 64))
    assert 400 < sym["r"] < paper_workload.gen_tokens_per_turn.mean() * 1.05
    assert sym["T_env"] == pytest.approx(sym["S"] * prior.env_per_turn_s)
    assert 0 < sym["f"] < 1 and sym["theta"] == pytest.approx((1 - sym["f"]) / sym["f"])
    assert 0.05 < sym["truncated_fraction"] < 0.4
    assert sym["K"] == 147456 and sym["BW"] == pytest.approx(80e9)
    assert prior.provenance is Provenance.CATALOG
    assert prior.key.model == "qwen3-8b" and prior.key.tp == 2 and prior.key.device == "catalog"


def test_json_round_trip(prior):
    raw = json.loads(json.dumps(profile_to_dict(prior)))
    again = profile_from_dict(raw)
    assert again == prior
    assert again.S == pytest.approx(prior.S)


def test_a_profile_stored_before_the_prefix_reuse_loads_with_the_engines(prior):
    raw = json.loads(json.dumps(profile_to_dict(prior)))
    assert raw["engine"].pop("turn_prefix_reuse") == perfmodel.TURN_PREFIX_REUSE
    assert profile_from_dict(raw).engine.turn_prefix_reuse == perfmodel.TURN_PREFIX_REUSE


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("engine"), "engine"),
        (lambda d: d["engine"].update(prefill_s_per_token=-1.0), "engine.prefill_s_per_token"),
        (lambda d: d.update(decode_fraction=0.0), "decode_fraction"),
        (lambda d: d["workload"].update(env_s=[1.0, math.nan]), "workload.env_s"),
        (lambda d: d["workload"].update(turns=[]), "workload.turns"),
        (lambda d: d["engine"].update(decode_batches=[1, 4, 2]), "engine.decode_batches"),
        (lambda d: d.update(batch_size="many"), "batch_size"),
        (lambda d: d["engine"].update(turn_prefix_reuse=1.5), "engine.turn_prefix_reuse"),
        (lambda d: d["engine"].update(turn_prefix_reuse=-0.1), "engine.turn_prefix_reuse"),
        (lambda d: d["engine"].update(turn_prefix_reuse="some"), "engine.turn_prefix_reuse"),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(prior, mutate, message):
    raw = json.loads(json.dumps(profile_to_dict(prior)))
    mutate(raw)
    with pytest.raises(BadInput, match=message):
        profile_from_dict(raw)


def test_pools_drive_the_symbols(prior):
    longer = replace(
        prior, workload=replace(prior.workload, gen_tokens=tuple(2 * x for x in prior.workload.gen_tokens))
    )
    assert longer.r > 1.5 * prior.r
    assert longer.S < prior.S  # more tokens a turn: the context cap ends trajectories sooner
    const = WorkloadPools((1000.0,), (3.0,), (100.0,), (50.0,), (2.0,))
    p = replace(prior, workload=const, max_context_tokens=100_000)
    assert p.S == 3 and p.r == 100 and p.T_env == pytest.approx(3 * 2.0 * 2 / 3)
    assert p.delta_l == pytest.approx((1000 + 2 * 50) / 3)
