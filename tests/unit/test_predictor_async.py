"""The predictor under asynchronous batches (ROLL's): the slots' interval, the split's role
efficiencies, the per-mode correction learned from what ran, and the switching margin it yields."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from pearl.controlplane.core.domain import Mode
from pearl.controlplane.core.predictor import Config, predict
from pearl.controlplane.core.profile import (
    MODEL_ERROR,
    Rollout,
    profile_from_dict,
    profile_to_dict,
)
from pearl.controlplane.core.selector import select
from pearl.controlplane.core.switching import RATIO_ERROR, SwitchCosts, margin
from pearl.controlplane.core.tracker import fit_profile
from pearl.controlplane.errors import BadInput
from pearl.sim.ratio import prior_profile, run_static
from pearl.sim.scenario import load_scenario

pytestmark = pytest.mark.unit

SCENARIO = "ablation-qwen3-8b-dedicated16"
FREE = SwitchCosts(cold_start_s=0.0, admit_s=0.0, role_switch_s=0.0)


@pytest.fixture(scope="module")
def scenario():
    return load_scenario(SCENARIO, ["duration_s=3600"])


@pytest.fixture(scope="module")
def prior(scenario):
    return prior_profile(scenario)


def test_the_scenarios_loop_reaches_the_profile(scenario, prior):
    ro = prior.rollout
    t = scenario.training
    assert ro.is_async and ro.trajectories_per_slot == t.trajectories_per_slot == 2
    assert ro.update_gap_s == t.step_s + t.weight_sync_s and ro.update_pause_s == t.weight_sync_s
    assert ro.abort_on_update and ro.slots(prior.batch_size) == prior.batch_size // 2
    assert profile_from_dict(profile_to_dict(prior)) == prior


def test_the_interval_lies_between_the_slots_mean_work_and_the_barrier(prior):
    """The slots keep the fleet busy across batches: a batch's interval is at least each slot's mean
    work (its trajectories, back to back) and less than the per-batch barrier's makespan, which
    waits for the slowest trajectory with the fleet emptying."""
    for config in (Config.colocated(8), Config.split(3, 5)):
        run = predict(prior, config)
        mean_work = prior.rollout.trajectories_per_slot * run.diagnostics["mean_trajectory_s"]
        barrier = predict(replace(prior, rollout=Rollout()), config)
        assert mean_work < run.makespan_s < barrier.makespan_s + mean_work
        assert run.components["slot_wait_s"] > 0  # slots wait for the batch to be created or finish
        assert 0.8 * prior.rollout.slots(prior.batch_size) < run.diagnostics["concurrent_trajectories"] \
            <= prior.rollout.slots(prior.batch_size)


def test_a_longer_training_step_and_a_later_batch_lengthen_the_interval(prior):
    config = Config.colocated(8)
    base = predict(prior, config).makespan_s
    slow = replace(prior, rollout=replace(prior.rollout, update_gap_s=prior.rollout.update_gap_s + 400.0))
    assert predict(slow, config).makespan_s > base
    eager = replace(prior, rollout=replace(prior.rollout, staleness=2))
    assert predict(eager, config).makespan_s <= base


def test_the_remaining_time_falls_as_the_batch_ends(prior):
    config = Config.split(3, 5)
    left = [predict(prior, config, remaining_fraction=r).makespan_s for r in (1.0, 0.5, 0.1, 1 / 64)]
    assert all(a > b > 0 for a, b in zip(left, left[1:], strict=False)), left
    with pytest.raises(BadInput, match="remaining_fraction"):
        predict(prior, config, remaining_fraction=0.0)


def test_a_split_is_timed_at_its_roles_efficiencies(prior):
    """Decode-only workers decode faster than colocated ones, prefill-only workers prefill slower
    (perfmodel's serving efficiencies by role); colocation is untouched by either."""
    e = prior.engine
    assert e.decode_only_scale < 1 < e.prefill_only_scale
    same = replace(prior, engine=replace(e, decode_only_scale=1.0, prefill_only_scale=1.0))
    split, colocated = Config.split(3, 5), Config.colocated(8)
    assert predict(same, colocated).makespan_s == predict(prior, colocated).makespan_s
    ours, flat = predict(prior, split), predict(same, split)
    assert ours.components["decode_s"] < flat.components["decode_s"]
    assert ours.components["prefill_s"] > flat.components["prefill_s"]


@pytest.mark.parametrize("config", [Config.colocated(8), Config.split(3, 5), Config.split(4, 4)])
def test_the_prior_predicts_the_simulated_interval(scenario, prior, config):
    """The model alone (the catalog prior, nothing fitted) against the simulator on the same
    workload: the mean interval of seven steps after the first, within 6% (their own spread is
    about 15% a step, 6% over seven)."""
    run = run_static(scenario, config, stop_after=8)
    simulated = float(np.mean(run.makespans[1:]))
    assert predict(prior, config).makespan_s == pytest.approx(simulated, rel=0.06)


def _steps(scenario, prior, config, n):
    run = run_static(scenario, config, stop_after=n + 1)
    return list(zip(run.telemetry, run.makespans, strict=True))[1:]


def test_a_mode_that_ran_is_predicted_from_its_own_steps(scenario, prior):
    """The tracker folds each step's measured over predicted time into its mode's correction; the
    mode that ran is then predicted from it, more closely and with less error the more steps ran,
    and the other mode keeps the model alone."""
    config = Config.colocated(8)
    profile, seen = prior, []
    for telemetry, makespan in _steps(scenario, prior, config, 8):
        profile = fit_profile(profile, telemetry, makespan_s=1.5 * makespan, config=config)  # the model 1.5x off
        seen.append(profile.mode_adjustment("colocated"))
    n, mean, square = profile.mode_correction("colocated")
    assert n == 8 and mean > 0.3 and square >= mean**2
    factors, errors = zip(*seen, strict=True)
    assert 1 < factors[0] < factors[-1] < math.exp(mean), factors
    assert errors[-1] < errors[0] < MODEL_ERROR, errors
    assert profile.mode_adjustment("split") == (1.0, MODEL_ERROR)
    factor = factors[-1]
    raw = replace(profile, mode_corrections=())
    assert predict(profile, config).makespan_s == pytest.approx(factor * predict(raw, config).makespan_s)
    assert predict(profile, Config.split(3, 5)).makespan_s == predict(raw, Config.split(3, 5)).makespan_s
    assert predict(profile, config).diagnostics["mode_correction"] == pytest.approx(factor)
    assert profile_from_dict(profile_to_dict(profile)) == profile


def test_a_stored_correction_is_checked_field_by_field(prior):
    raw = profile_to_dict(replace(prior, mode_corrections=(("colocated", 3, 0.1, 0.02),)))
    raw["mode_corrections"] = [["sideways", 3, 0.1, 0.02]]
    with pytest.raises(BadInput, match="mode_corrections"):
        profile_from_dict(raw)
    raw["mode_corrections"] = [["split", 0, 0.1, 0.02]]
    with pytest.raises(BadInput, match="mode_corrections"):
        profile_from_dict(raw)
    raw = profile_to_dict(prior)
    raw["rollout"]["batching"] = "sometimes"
    with pytest.raises(BadInput, match="rollout.batching"):
        profile_from_dict(raw)
    raw = profile_to_dict(prior)
    raw["engine"]["decode_only_scale"] = 0.0
    with pytest.raises(BadInput, match="decode_only_scale"):
        profile_from_dict(raw)


def test_the_switching_margin_is_the_predictions_measured_error(prior):
    """A mode switch needs a gain beyond the error of two modes' predictions, a ratio change beyond
    the error from one ratio to another; once a mode has run, its error and the margin shrink."""
    assert margin(0.03, 0.04, same_mode=False) == pytest.approx(0.05)
    assert margin(0.03, 0.04, same_mode=True) == pytest.approx(math.sqrt(2) * RATIO_ERROR)
    # from colocation, 2P6D is predicted ~3.5% faster: within two unmeasured modes' error (5.7%), so
    # the fleet stays; once both modes ran twenty steps with a 2% spread, the same gain switches
    fresh = select(prior, 8, Config.colocated(8), costs=FREE, horizon_s=3600.0)
    ran = replace(prior, mode_corrections=(("colocated", 20, 0.0, 0.0004), ("split", 20, 0.0, 0.0004)))
    known = select(ran, 8, Config.colocated(8), costs=FREE, horizon_s=3600.0)
    assert fresh.best == known.best and fresh.best.mode is Mode.SPLIT
    assert not fresh.switched and known.switched and known.chosen == known.best
    unmeasured = fresh.decision.threshold_s - fresh.decision.cost_s
    measured = known.decision.threshold_s - known.decision.cost_s
    assert unmeasured == pytest.approx(math.sqrt(2) * MODEL_ERROR * fresh.decision.work_s)
    assert measured < unmeasured / 4
