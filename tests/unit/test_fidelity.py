"""The calibration set (the paper's §3, docs/fidelity.md): every figure within 25% of the paper, or a
strict expected failure whose reason docs/fidelity.md argues."""

from __future__ import annotations

import math

import pytest
from pearl.controlplane.core import perfmodel
from pearl.sim import fidelity
from pearl.sim.ratio import prior_profile
from pearl.sim.scenario import load_scenario, serving_perf

pytestmark = pytest.mark.unit

TOLERANCE = 0.25
PAPER = fidelity.PAPER


def _within(sim: float, paper: float) -> None:
    assert abs(sim / paper - 1) <= TOLERANCE, f"{sim:.4g} vs the paper's {paper:.4g}"


@pytest.fixture(scope="module")
def fig2a():
    return fidelity.fig2a()


def test_fig2a_rollout_time_at_16_24_32_gpus(fig2a):
    for gpus, paper in PAPER["fig2a"]["makespan_s"].items():
        _within(fig2a["makespan_s"][gpus], paper)


def test_fig2a_trajectory_duration_rollout_over_training_and_rollout_share(fig2a):
    _within(fig2a["trajectory_mean_s"], PAPER["fig2a"]["trajectory_mean_s"])
    low, high = PAPER["fig2a"]["rollout_over_training"]
    _within(fig2a["rollout_over_training"][0], low)  # at 32 GPUs
    _within(fig2a["rollout_over_training"][1], high)  # at 16 GPUs
    _within(fig2a["rollout_share_32"], PAPER["fig2a"]["rollout_share_32"])


@pytest.mark.xfail(strict=True, reason=(
    "docs/fidelity.md, 'What the fit cannot reach': the simulated makespan is the slowest trajectory's, "
    "which runs its last turns alone on a worker whatever the fleet size; only prefill interference "
    "scales with the load, so rollout falls 3-5% from 16 to 24 GPUs and ~1% from 24 to 32 "
    "(paper: 10.3% and 8.9%)"))
def test_fig2a_rollout_time_falls_with_more_gpus(fig2a):
    _within(fig2a["fall_16_24"], PAPER["fig2a"]["fall_16_24"])
    _within(fig2a["fall_24_32"], PAPER["fig2a"]["fall_24_32"])


def test_fig2b_prefill_shares_of_tokens_and_time():
    b = fidelity.fig2b()
    _within(b["prefill_token_share"], PAPER["fig2b"]["prefill_token_share"])
    _within(b["prefill_time_share"], PAPER["fig2b"]["prefill_time_share"])


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "docs/fidelity.md, 'What the fit cannot reach': split and colocated stay within ~2-4% of each "
    "other at every batch (colocated ahead) and the best split is 2P6D-3P5D; the paper has the split "
    "9.7% ahead at batch 32 and 6.1% behind at 96"))
def test_fig2c_split_against_colocated_over_batch_size():
    c, _ = fidelity.fig2c()
    for batch, gain in PAPER["fig2c"]["split_gain"].items():
        assert abs(c["split_gain"][batch] - gain) <= 0.03, (batch, c["split_gain"][batch], gain)
    assert c["best_ratio"][48] == "4P4D" and c["best_ratio"][64] == "5P3D"


def test_the_fit_is_frozen_within_its_ranges():
    for value, (low, high) in ((perfmodel.AGENTIC_DECODE_EFFICIENCY, perfmodel.AGENTIC_DECODE_EFFICIENCY_RANGE),
                               (perfmodel.AGENTIC_PREFILL_EFFICIENCY, perfmodel.AGENTIC_PREFILL_EFFICIENCY_RANGE),
                               (perfmodel.TURN_PREFIX_REUSE, perfmodel.TURN_PREFIX_REUSE_RANGE)):
        assert low <= value <= high
    # the MoE experts stream at the measured kernel efficiency (H200 fused MoE: 0.54-0.67)
    assert 0.54 <= perfmodel.MOE_EXPERT_BW_EFFICIENCY <= 0.67


# -- the scan of the free parameters (bench/fidelity_scan.py): its method, not its numbers ------------


def test_the_latin_hypercube_puts_one_setting_in_each_slice_of_every_range():
    dims = fidelity.scan_space()
    settings = fidelity.latin_hypercube(8, dims, seed=3)
    assert len(settings) == 8 and settings == fidelity.latin_hypercube(8, dims, seed=3)
    for d in dims:
        values = [s[d.name] for s in settings]
        assert all(d.low <= v <= d.high for v in values), d.name
        # back to [0, 1] of the (log) range: one value in each eighth
        span = [(math.log(v / d.low) / math.log(d.high / d.low)) if d.log else (v - d.low) / (d.high - d.low)
                for v in values]
        assert sorted(int(u * 8) for u in span) == list(range(8)), d.name
    with pytest.raises(ValueError, match="points"):
        fidelity.latin_hypercube(0, dims, seed=3)


def test_the_local_hypercube_stays_within_its_span_around_the_fit():
    dims = fidelity.scan_space()
    settings = fidelity.latin_hypercube(6, dims, seed=4, span=0.3)
    for d in dims:
        u = [d.where(s[d.name]) for s in settings]
        lo = min(max(d.where(d.fitted) - 0.15, 0.0), 0.7)  # clipped to the range, 0.3 wide
        assert all(lo - 1e-9 <= x <= lo + 0.3 + 1e-9 for x in u), d.name
        assert sorted(int((x - lo) / 0.3 * 6) for x in u) == list(range(6)), d.name
        assert d.where(d.at(0.37)) == pytest.approx(0.37)
    with pytest.raises(ValueError, match="span"):
        fidelity.latin_hypercube(4, dims, seed=4, span=0.0)


def test_the_scan_space_is_section_1s_ranges_around_the_fit():
    dims = {d.name: d for d in fidelity.scan_space()}
    assert dims["decode_efficiency"].fitted == perfmodel.AGENTIC_DECODE_EFFICIENCY
    assert (dims["turn_prefix_reuse"].low, dims["turn_prefix_reuse"].high) == perfmodel.TURN_PREFIX_REUSE_RANGE
    for d in dims.values():
        assert d.low <= d.fitted <= d.high, d.name
    points = fidelity.scan_points(5, local=3)
    assert points[0]["kind"] == "fitted" and len(points) == 1 + 2 * len(dims) + 5 + 3
    assert [p["kind"] for p in points[-8:]] == ["latin-hypercube"] * 5 + ["local-hypercube"] * 3
    # each one-at-a-time point moves exactly one parameter to one end of its range
    for p in points[1:1 + 2 * len(dims)]:
        moved = [k for k, v in p["setting"].items() if v != points[0]["setting"][k]]
        assert len(moved) <= 1 and p["kind"].startswith(moved[0] if moved else "turn_prefix_reuse")


def test_a_settings_workload_is_the_fitted_shape_moved_to_its_figures():
    fitted = {d.name: d.fitted for d in fidelity.scan_space()}
    base = load_scenario(fidelity.BASE).workload
    same = load_scenario(fidelity.BASE, fidelity.workload_overrides(fitted)).workload
    for name in ("turns", "gen_tokens_per_turn", "obs_tokens_per_turn", "env_latency_s"):
        assert getattr(same, name).median == pytest.approx(getattr(base, name).median, rel=1e-5), name
        assert getattr(same, name).p99 == pytest.approx(getattr(base, name).p99, rel=1e-5), name
    moved = load_scenario(fidelity.BASE, fidelity.workload_overrides(
        {**fitted, "turns_mean": 64.0, "gen_tokens_median": 1000.0, "env_mean_s": 4.0})).workload
    assert moved.turns.p99 / moved.turns.median == pytest.approx(base.turns.p99 / base.turns.median, rel=1e-5)
    assert moved.turns.median * math.exp(moved.turns.sigma ** 2 / 2) == pytest.approx(64.0, rel=1e-4)
    assert moved.gen_tokens_per_turn.median == 1000.0
    assert moved.env_latency_s.median == base.env_latency_s.median
    assert moved.env_latency_s.mean() == pytest.approx(4.0, rel=1e-4)


def test_an_engine_setting_applies_to_the_engine_and_the_prior_and_is_undone():
    setting = {"decode_efficiency": 0.6, "prefill_efficiency": 0.5, "turn_prefix_reuse": 0.5}
    sc = load_scenario(fidelity.BASE)
    before = serving_perf(sc).serving, perfmodel.TURN_PREFIX_REUSE
    with fidelity.engine_setting(setting):
        assert serving_perf(sc).serving == perfmodel.ServingEfficiency(0.6, 0.5)
        assert prior_profile(sc).engine.turn_prefix_reuse == 0.5
    assert (serving_perf(sc).serving, perfmodel.TURN_PREFIX_REUSE) == before


def _paper_figures() -> dict:
    """The paper's own figures in the shape `evaluate` gives them."""
    a, c = PAPER["fig2a"], PAPER["fig2c"]
    return {
        "fig2a": {"makespan_s": dict(a["makespan_s"]), "fall_16_24": a["fall_16_24"], "fall_24_32": a["fall_24_32"],
                  "rollout_over_training": a["rollout_over_training"], "trajectory_mean_s": a["trajectory_mean_s"],
                  "rollout_share_32": a["rollout_share_32"]},
        "fig2b": dict(PAPER["fig2b"]),
        "fig2c": {"split_gain": dict(c["split_gain"]), "best_ratio": dict(c["best_ratio"])},
    }


def test_the_paper_holds_every_reached_figure_and_reaches_every_missed_one():
    figs = _paper_figures()
    assert fidelity.held_broken(figs) == []
    assert all(m["reached"] and m["distance"] == 0 for m in fidelity.missed(figs).values())
    off = _paper_figures()
    off["fig2b"]["prefill_time_share"] *= 1.3
    off["fig2a"]["makespan_s"][24] *= 0.7
    off["fig2c"]["best_ratio"][48] = "2P6D"
    off["fig2c"]["split_gain"][96] += 0.05
    assert fidelity.held_broken(off) == ["fig2a.makespan_s.24", "fig2b.prefill_time_share"]
    m = fidelity.missed(off)
    assert m["fig2c.best_ratio.48"]["distance"] == -2 and not m["fig2c.best_ratio.48"]["reached"]
    assert m["fig2c.split_gain.96"]["distance"] == pytest.approx(0.05) and not m["fig2c.split_gain.96"]["reached"]


def test_the_best_reachable_is_the_closest_among_settings_that_hold_and_among_all():
    near = _paper_figures()  # reaches the falls, but breaks Fig. 2b
    near["fig2b"]["prefill_token_share"] = 0.5
    far = _paper_figures()  # holds everything, the falls short
    far["fig2a"]["fall_16_24"] = 0.05
    farther = _paper_figures()
    farther["fig2a"]["fall_16_24"] = 0.02
    results = [{"setting": {"n": i}, "figures": f, "broken": fidelity.held_broken(f)}
               for i, f in enumerate((farther, near, far))]
    best = fidelity.best_reachable(results)["fig2a.fall_16_24"]
    assert best["held"]["setting"] == {"n": 2} and not best["held"]["reached"]
    assert best["held"]["distance"] == pytest.approx(0.05 / 0.103 - 1, abs=1e-4)
    assert best["any"]["setting"] == {"n": 1} and best["any"]["broken"] == ["fig2b.prefill_token_share"]
    assert best["evaluated"] == 3
    # a setting without Fig. 2c counts for Fig. 2a's figures only
    del far["fig2c"]
    assert fidelity.best_reachable(results)["fig2c.split_gain.32"]["evaluated"] == 2


def test_the_scans_fitted_setting_is_the_frozen_model(fig2a):
    fitted = {d.name: d.fitted for d in fidelity.scan_space()}
    figs = fidelity.evaluate(fitted, with_fig2c=False)
    assert figs["fig2a"] == fig2a
    assert figs["fig2b"] == fidelity.fig2b()
