"""Hysteresis: thresholds from measured switch costs and the remaining work; mode switch > ratio change."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pearl.controlplane.core.predictor import Config
from pearl.controlplane.core.switching import NOISE_MARGIN, SwitchCosts, decide_switch, switch_cost_s
from pearl.controlplane.errors import BadInput

pytestmark = pytest.mark.unit

COSTS = SwitchCosts(cold_start_s=60.0, admit_s=12.0, role_switch_s=8.0, weight_sync_s=2.0)


def test_ratio_change_costs_the_flips_spread_over_the_fleet():
    # a flip re-registers with the router: role_switch_s only, no group admission (as the executor enacts it)
    assert switch_cost_s(Config.split(2, 6), Config.split(4, 4), COSTS) == pytest.approx(2 * 8 / 8)
    assert switch_cost_s(Config.split(2, 6), Config.split(2, 6), COSTS) == 0.0
    assert switch_cost_s(Config.colocated(8), Config.colocated(8), COSTS) == 0.0


def test_mode_switch_costs_a_whole_fleet_restart():
    cost = switch_cost_s(Config.colocated(8), Config.split(2, 6), COSTS, refill_s=5.0)
    assert cost == pytest.approx(60 + 2 + 12 + 5)
    assert switch_cost_s(Config.split(2, 6), Config.colocated(8), COSTS) == pytest.approx(74)


def test_budget_change_charges_only_the_shape():
    # 2P6D at 8 continues as 3P9D at 12 (same ratio): going to 4P8D flips one worker
    assert switch_cost_s(Config.split(2, 6), Config.split(4, 8), COSTS) == pytest.approx(8 / 12)


def test_switch_only_when_the_gain_beats_cost_plus_margin():
    keep = decide_switch(Config.split(2, 6), 300.0, Config.split(3, 5), 297.0, COSTS)
    assert not keep.switch and keep.gain_s == pytest.approx(3.0)
    assert keep.threshold_s == pytest.approx(keep.cost_s + NOISE_MARGIN * 300.0)
    assert "keep" in keep.reason and "ratio change" in keep.reason
    go = decide_switch(Config.split(2, 6), 300.0, Config.split(3, 5), 270.0, COSTS)
    assert go.switch and go.gain_s == pytest.approx(30.0) and "switch" in go.reason


def test_the_remaining_work_and_horizon_scale_the_gain():
    # a 10% better mode does not pay for a 74 s restart within one 300 s step ...
    one_step = decide_switch(Config.colocated(8), 300.0, Config.split(2, 6), 270.0, COSTS)
    assert not one_step.switch and "mode switch" in one_step.reason
    # ... but does over an hour of rollout at the new budget
    hour = decide_switch(Config.colocated(8), 300.0, Config.split(2, 6), 270.0, COSTS, horizon_s=3600.0)
    assert hour.switch and hour.work_s == pytest.approx(3900.0)
    # near the end of a step the same 15% gain no longer pays for two flips
    early = decide_switch(Config.split(2, 6), 300.0, Config.split(4, 4), 255.0, COSTS)
    late = decide_switch(Config.split(2, 6), 12.0, Config.split(4, 4), 10.2, COSTS)
    assert early.switch and not late.switch


@given(
    cold=st.floats(1, 300),
    role=st.floats(0, 60),
    admit=st.floats(0, 60),
    sync=st.floats(0, 30),
    current=st.floats(1, 5000),
    candidate=st.floats(0, 5000),
    horizon=st.floats(0, 1e5),
    n=st.integers(2, 64),
    p=st.integers(1, 63),
)
def test_mode_switch_threshold_is_larger_than_a_ratio_change(
    cold, role, admit, sync, current, candidate, horizon, n, p
):
    if p >= n or cold < role:
        return
    costs = SwitchCosts(cold_start_s=cold, admit_s=admit, role_switch_s=role, weight_sync_s=sync)
    src = Config.split(p, n - p)
    ratio = decide_switch(
        src, current, Config.split(n - p, p) if n - p != p else src, candidate, costs, horizon_s=horizon
    )
    mode = decide_switch(src, current, Config.colocated(n), candidate, costs, horizon_s=horizon)
    assert mode.threshold_s >= ratio.threshold_s
    assert mode.switch <= ratio.switch or ratio.threshold_s == mode.threshold_s


def test_costs_follow_measurements():
    c = COSTS.observe("role_switch_s", 18.0, alpha=0.5)
    assert c.role_switch_s == pytest.approx(13.0) and c.cold_start_s == 60.0
    with pytest.raises(BadInput, match="unknown cost"):
        COSTS.observe("reboot_s", 1.0)
    with pytest.raises(BadInput, match="role_switch_s"):
        COSTS.observe("role_switch_s", float("nan"))
    with pytest.raises(BadInput, match="cold_start_s"):
        SwitchCosts(cold_start_s=-1.0, admit_s=0.0, role_switch_s=0.0)
    with pytest.raises(BadInput, match="horizon_s"):
        decide_switch(Config.colocated(2), 10.0, Config.split(1, 1), 5.0, COSTS, horizon_s=-1.0)


def test_costs_from_the_scenario_and_measured_steps():
    from pearl.sim.scenario import load_scenario

    sc = load_scenario("paper-qwen3-8b-seg1")
    costs = SwitchCosts.from_reconfig(sc.reconfig, sc.training.weight_sync_s)
    assert costs == SwitchCosts(cold_start_s=60.0, admit_s=12.0, role_switch_s=8.0, weight_sync_s=2.0)
    measured = costs.with_measured({"flip_role": 18.0, "start_dedicated": 60.0, "release_overlap": 3.0}, alpha=0.5)
    assert measured.role_switch_s == pytest.approx(13.0) and measured.cold_start_s == 60.0
    assert measured.admit_s == 12.0
