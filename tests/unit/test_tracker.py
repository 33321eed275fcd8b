"""The runtime tracker: each step's telemetry refits the profile (pools, engine, f, T_over)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.core.predictor import Config, predict, predict_batch
from pearl.controlplane.core.profile import (
    Provenance,
    draw_trajectories,
    pools_from_workload,
    profile_from_dict,
    profile_from_workload,
    profile_to_dict,
)
from pearl.controlplane.core.telemetry import parse_telemetry
from pearl.controlplane.core.tracker import censored_distribution, fit_profile, trajectory_sample
from pearl.controlplane.errors import BadInput
from pearl.sim.scenario import load_scenario

pytestmark = pytest.mark.unit

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"


@pytest.fixture(scope="module")
def perf() -> PerfModel:
    cat = default_catalog()
    return PerfModel(cat.model("qwen3-8b"), cat.gpu("h800"), 2)


@pytest.fixture(scope="module")
def workload():
    return load_scenario(SCENARIOS / "paper-qwen3-8b-seg1.yaml").workload


@pytest.fixture(scope="module")
def prior(workload, perf):
    return profile_from_workload(workload, perf)


def telemetry(workload, perf, step=0, seed=1, env_scale=1.0, gen_scale=1.0, decode_slowdown=1.0, prefill_speedup=1.0):
    """One step's telemetry as the simulator reports it: trajectories and iteration timings."""
    pools = pools_from_workload(workload)
    pools = replace(pools, gen_tokens=tuple(x * gen_scale for x in pools.gen_tokens))
    s = draw_trajectories(pools, workload.max_context_tokens, workload.batch_size, seed=seed)
    trajectories = []
    for j in range(workload.batch_size):
        n = int(s.turns[j])
        trajectories.append(
            {
                "turns": n,
                "prompt_tokens": int(s.prompt[j]),
                "gen_tokens": [int(x) for x in s.gen[j, :n]],
                "obs_tokens": [int(x) for x in s.obs[j, : n - 1]],
                "env_s": [float(x) * env_scale for x in s.env[j, : n - 1]],
                "truncated": bool(s.truncated[j]),
            }
        )
    iterations = [
        {"worker": 0, "role": "decode", "batch": b, "context_tokens_mean": c, "prefill_tokens": 0,
         "seconds": decode_slowdown * perf.decode_step_time(b, c)}
        for b in (4, 8, 16) for c in (5000.0, 12000.0, 20000.0)
    ] + [
        {"worker": 1, "role": "prefill", "batch": 0, "context_tokens_mean": c, "prefill_tokens": 2048,
         "seconds": perf.prefill_time(2048, c) / prefill_speedup}
        for c in (0.0, 8000.0, 16000.0)
    ]  # fmt: skip
    raw = {"step": step, "batch_size": workload.batch_size, "trajectories": trajectories, "iterations": iterations}
    return parse_telemetry(raw | {"decode_fraction": 0.55})


def test_first_step_replaces_the_prior(prior, workload, perf):
    t = telemetry(workload, perf, env_scale=3.0)
    fitted = fit_profile(prior, t)
    assert fitted.provenance is Provenance.FITTED and fitted.steps_observed == 1
    assert fitted.fit["alpha"] == 1.0 and fitted.fit["trajectories"] == 64
    measured_env = [x for tr in t.trajectories for x in tr.env_s]
    pool = fitted.workload
    assert np.interp(0.5, pool.levels, pool.env_s) == pytest.approx(np.median(measured_env), rel=0.05)
    assert pool.env_s[-1] == max(measured_env)  # the far tail is the largest wait seen
    assert fitted.env_per_turn_s > 2 * prior.env_per_turn_s
    assert fitted.decode_fraction == pytest.approx(0.55)
    assert fitted.key == prior.key


def test_later_steps_average_then_forget(prior, workload, perf):
    p = fit_profile(prior, telemetry(workload, perf, step=0, seed=1))
    assert fit_profile(p, telemetry(workload, perf, step=1, seed=2)).fit["alpha"] == 0.5
    for step in range(1, 40):
        p = fit_profile(p, telemetry(workload, perf, step=step, seed=step + 1, gen_scale=1.5))
    assert p.fit["alpha"] == pytest.approx(0.05)  # the window floor
    # the workload drifted to 1.5x generation: the profile followed
    assert p.r > 1.3 * prior.r


def test_engine_refit_from_iterations(prior, workload, perf):
    fitted = fit_profile(prior, telemetry(workload, perf, decode_slowdown=1.3, prefill_speedup=1.25))
    assert fitted.fit["decode_ratio"] == pytest.approx(1.3)
    assert fitted.fit["prefill_ratio"] == pytest.approx(0.8)
    assert float(fitted.engine.decode_iteration_s(8, 12000.0)) == pytest.approx(1.3 * perf.decode_step_time(8, 12000.0))
    assert fitted.engine.prefill_s_per_token == pytest.approx(0.8 * prior.engine.prefill_s_per_token)
    # bins without measurements keep the prior
    assert fitted.engine.decode_base_s[-1] == prior.engine.decode_base_s[-1]


def test_no_iterations_keep_the_engine(prior, workload, perf):
    t = telemetry(workload, perf)
    bare = t.model_copy(update={"iterations": [], "decode_fraction": None})
    fitted = fit_profile(prior, bare)
    assert fitted.engine == prior.engine and fitted.decode_fraction == prior.decode_fraction


def test_t_over_fitted_from_the_step_makespan(prior, workload, perf):
    t = telemetry(workload, perf)
    plain = fit_profile(prior, t)
    batch = trajectory_sample(t.trajectories)
    config = Config.colocated(7)
    # the residual is taken against this very batch, so a step that ran as predicted fits T_over = 0
    on_time = predict_batch(plain, config, batch).makespan_s
    assert fit_profile(prior, t, makespan_s=on_time, config=config).t_over_s == pytest.approx(0.0, abs=1e-9)
    late = fit_profile(prior, t, makespan_s=on_time + 40.0, config=config)
    assert late.t_over_s == pytest.approx(40.0 / batch.turns.max())
    assert predict(late, config).makespan_s > predict(plain, config).makespan_s + 20.0
    # a faster step makes the signed residual negative; T_over stays >= 0 and the next slow step
    # must first pay that back (noise averages out instead of ratcheting up)
    early = fit_profile(prior, t, makespan_s=on_time - 40.0, config=config)
    assert early.t_over_s == 0.0 and early.overhead_residual_s < 0
    t2 = telemetry(workload, perf, step=1, seed=2)
    again = fit_profile(
        early,
        t2,
        makespan_s=predict_batch(early, config, trajectory_sample(t2.trajectories)).makespan_s + 40.0,
        config=config,
    )
    assert again.overhead_residual_s == pytest.approx(
        0.5 * early.overhead_residual_s + 0.5 * 40.0 / trajectory_sample(t2.trajectories).turns.max()
    )


def test_truncation_censors_turns():
    values, probs = censored_distribution([2, 3, 5, 4], [False, False, False, True], tail=(6.0, 8.0))
    assert probs.sum() == pytest.approx(1.0)
    dist = dict(zip(values.tolist(), probs.tolist(), strict=True))
    assert dist[2] == pytest.approx(0.25) and dist[3] == pytest.approx(0.25)
    # the censored trajectory (4+ turns) is at risk until it leaves: the event at 5 takes its share
    assert dist[5] == pytest.approx(0.5) and 6.0 not in dist
    # censored past the last event: its share follows the previous pool above its own bound
    values, probs = censored_distribution([2, 3, 6], [False, False, True], tail=(4.0, 6.0, 8.0))
    dist = dict(zip(values.tolist(), probs.tolist(), strict=True))
    assert dist[6] == pytest.approx(1 / 6) and dist[8] == pytest.approx(1 / 6) and 4.0 not in dist
    values, probs = censored_distribution([2, 9], [False, True], tail=(4.0, 6.0, 8.0))
    assert values.tolist() == [2.0, 9.0] and probs.tolist() == [0.5, 0.5]  # nothing above 9 in the tail
    values, probs = censored_distribution([3, 3], [True, True], tail=())
    assert values.tolist() == [3.0] and probs.tolist() == [1.0]


def test_round_trip_and_device_rekey(prior, workload, perf):
    fitted = fit_profile(prior, telemetry(workload, perf), device="node-a")
    assert fitted.key.device == "node-a" and fitted.key.model == "qwen3-8b"
    again = profile_from_dict(json.loads(json.dumps(profile_to_dict(fitted))))
    assert again == fitted and again.fit == fitted.fit


def test_bad_arguments_are_refused(prior, workload, perf):
    t = telemetry(workload, perf)
    with pytest.raises(BadInput, match="alpha_min"):
        fit_profile(prior, t, alpha_min=0)
    with pytest.raises(BadInput, match="makespan_s"):
        fit_profile(prior, t, makespan_s=math.nan, config=Config.colocated(4))
    empty = t.model_copy(update={"trajectories": [t.trajectories[0].model_copy(update={"turns": 0})]})
    with pytest.raises(BadInput, match="telemetry.trajectories"):
        fit_profile(prior, empty)


def test_bad_telemetry_is_refused_before_the_tracker(workload, perf):
    raw = json.loads(telemetry(workload, perf).model_dump_json())
    raw["trajectories"][0]["gen_tokens"][0] = -5
    with pytest.raises(BadInput, match=r"trajectories\[0\].gen_tokens"):
        parse_telemetry(raw)


def test_cut_generations_and_dropped_observations_are_censored_not_ignored(perf):
    """Under a tight context cap most trajectories end truncated; the cut generation and the
    observation that no longer fitted are lower bounds. Kaplan-Meier keeps the token pools unbiased."""
    tight = load_scenario(SCENARIOS / "paper-qwen3-8b-seg1.yaml", ["workload.max_context_tokens=9000"]).workload
    prior = profile_from_workload(tight, perf)
    steps = [telemetry(tight, perf, step=i, seed=10 + i) for i in range(4)]
    assert np.mean([t.truncated for s in steps for t in s.trajectories]) > 0.8
    fitted = prior
    for t in steps:
        fitted = fit_profile(fitted, t)
    truth = pools_from_workload(tight)
    # the upper quartile of tokens per turn is where dropping the cut values would bite
    for name in ("gen_tokens", "obs_tokens"):
        q75 = np.interp(0.75, fitted.workload.levels, getattr(fitted.workload, name))
        assert q75 == pytest.approx(np.interp(0.75, truth.levels, getattr(truth, name)), rel=0.1), name
    # taking the cut values at face value would bias the tokens per turn low
    face_value = [x for s in steps for t in s.trajectories for x in t.gen_tokens]
    assert np.mean(face_value) < 0.95 * tight.gen_tokens_per_turn.mean()
    assert fitted.r == pytest.approx(prior.r, rel=0.1)
