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


@pytest.fixture(scope="module")
def fig2b():
    return fidelity.fig2b()


# What the frozen fit reaches on seed 1 (docs/fidelity.md, "3. Calibration: paper vs simulator, before
# and after"), and what it misses, each miss a strict expected failure whose reason section 4 argues.


def test_fig2a_rollout_time_falls_with_more_gpus(fig2a):
    _within(fig2a["fall_16_24"], PAPER["fig2a"]["fall_16_24"])
    _within(fig2a["fall_24_32"], PAPER["fig2a"]["fall_24_32"])


def test_fig2a_mean_trajectory(fig2a):
    _within(fig2a["trajectory_mean_s"], PAPER["fig2a"]["trajectory_mean_s"])


@pytest.mark.xfail(strict=True, reason=(
    "docs/fidelity.md, 'What the fit cannot reach': at 64 trajectories a batch, the rollout time's scale "
    "(934 s at 16 GPUs, 4.3x the mean trajectory) needs 4 trajectories per environment slot, which leaves "
    "the GPUs too idle for the falls with more GPUs; the fit keeps the falls and the trajectory, and "
    "rollout waits about 390 s at 16 GPUs"))
def test_fig2a_rollout_time_at_16_24_32_gpus_and_its_share(fig2a):
    for gpus, paper in PAPER["fig2a"]["makespan_s"].items():
        _within(fig2a["makespan_s"][gpus], paper)
    low, high = PAPER["fig2a"]["rollout_over_training"]
    _within(fig2a["rollout_over_training"][0], low)  # at 32 GPUs
    _within(fig2a["rollout_over_training"][1], high)  # at 16 GPUs
    _within(fig2a["rollout_share_32"], PAPER["fig2a"]["rollout_share_32"])


def test_fig2b_prefill_share_of_tokens(fig2b):
    _within(fig2b["prefill_token_share"], PAPER["fig2b"]["prefill_token_share"])


@pytest.mark.xfail(strict=True, reason=(
    "docs/fidelity.md, 'What the fit cannot reach': the fit's long generations (median ~1,900 tokens a "
    "turn) and fast prefill put prefill at ~11% of the time; the settings that reach 26.5% lose the falls "
    "or the trajectory"))
def test_fig2b_prefill_share_of_time(fig2b):
    _within(fig2b["prefill_time_share"], PAPER["fig2b"]["prefill_time_share"])


@pytest.mark.xfail(strict=True, reason=(
    "docs/fidelity.md, 'What the fit cannot reach': 64 trajectories over 8 workers decode ~3 at a time; "
    "no setting of the ranges reaches 400 decode tokens/s per GPU at that batch (the best: 293)"))
def test_fig2b_decode_rate_between_prefill_insertions(fig2b):
    _within(fig2b["decode_tok_s_per_gpu"], PAPER["fig2b"]["decode_tok_s_per_gpu"])


@pytest.fixture(scope="module")
def fig2c():
    return fidelity.fig2c()[0]


@pytest.mark.slow
def test_fig2c_split_against_colocated_at_batch_80(fig2c):
    assert abs(fig2c["split_gain"][80] - PAPER["fig2c"]["split_gain"][80]) <= fidelity.SPLIT_GAIN_POINTS


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "docs/fidelity.md, 'What the fit cannot reach': the split leads at batch 32 (+4.6%, short of +4.9%) but "
    "still leads at batch 96 (+0.5%, paper -6.1%), and the best ratio stays 2P6D (paper 4P4D, 5P3D): with "
    "prefill at ~11% of a colocated worker's time, more prefill workers do not pay"))
def test_fig2c_split_against_colocated_over_batch_size_and_best_ratios(fig2c):
    assert fig2c["split_gain"][32] >= fidelity.SPLIT_GAIN_FLOOR_32
    assert -0.061 - 0.03 <= fig2c["split_gain"][96] < 0
    assert fig2c["best_ratio"][48] == "4P4D" and fig2c["best_ratio"][64] == "5P3D"


def test_the_fit_is_frozen_within_its_ranges():
    for value, (low, high) in ((perfmodel.AGENTIC_DECODE_EFFICIENCY, perfmodel.AGENTIC_DECODE_EFFICIENCY_RANGE),
                               (perfmodel.AGENTIC_PREFILL_EFFICIENCY, perfmodel.AGENTIC_PREFILL_EFFICIENCY_RANGE),
                               (perfmodel.AGENTIC_DECODE_ONLY_EFFICIENCY,
                                perfmodel.AGENTIC_DECODE_ONLY_EFFICIENCY_RANGE),
                               (perfmodel.AGENTIC_PREFILL_ONLY_EFFICIENCY,
                                perfmodel.AGENTIC_PREFILL_ONLY_EFFICIENCY_RANGE),
                               (perfmodel.TURN_PREFIX_REUSE, perfmodel.TURN_PREFIX_REUSE_RANGE)):
        assert low <= value <= high
    # the MoE experts stream at the measured kernel efficiency (H200 fused MoE: 0.54-0.67)
    assert 0.54 <= perfmodel.MOE_EXPERT_BW_EFFICIENCY <= 0.67


# -- the fit and the scan (bench/fidelity_scan.py): their method, not their numbers ----------------


def test_the_latin_hypercube_puts_one_setting_in_each_slice_of_every_range():
    dims = fidelity.scan_space()
    settings = fidelity.latin_hypercube(6, dims, seed=3)
    assert len(settings) == 6 and settings == fidelity.latin_hypercube(6, dims, seed=3)
    for d in dims:
        values = [s[d.name] for s in settings]
        assert all(d.low <= v <= d.high for v in values), d.name
        if d.choices:  # a discrete parameter: its values spread over its choices, each taken
            assert set(values) == set(d.choices), d.name
            continue
        # back to [0, 1] of the (log) range: one value in each sixth
        span = [(math.log(v / d.low) / math.log(d.high / d.low)) if d.log else (v - d.low) / (d.high - d.low)
                for v in values]
        assert sorted(int(u * 6) for u in span) == list(range(6)), d.name
    with pytest.raises(ValueError, match="points"):
        fidelity.latin_hypercube(0, dims, seed=3)


def test_the_local_hypercube_stays_within_its_span_around_its_centre():
    dims = fidelity.scan_space()
    centre = {d.name: d.at(0.9) for d in dims}
    settings = fidelity.latin_hypercube(6, dims, seed=4, span=0.3, around=centre)
    for d in dims:
        if d.choices:
            continue
        u = [d.where(s[d.name]) for s in settings]
        lo = min(max(d.where(centre[d.name]) - 0.15, 0.0), 0.7)  # clipped to the range, 0.3 wide
        assert all(lo - 1e-9 <= x <= lo + 0.3 + 1e-9 for x in u), d.name
        assert sorted(int((x - lo) / 0.3 * 6) for x in u) == list(range(6)), d.name
        assert d.where(d.at(0.37)) == pytest.approx(0.37)
    with pytest.raises(ValueError, match="span"):
        fidelity.latin_hypercube(4, dims, seed=4, span=0.0)


def test_the_scan_space_is_the_plans_ranges_around_the_model_as_it_is():
    dims = {d.name: d for d in fidelity.scan_space()}
    assert set(dims) == set(fidelity.ROUND_1) == set(fidelity.fitted_setting())
    assert dims["decode_efficiency"].fitted == perfmodel.AGENTIC_DECODE_EFFICIENCY
    assert (dims["decode_only_efficiency"].low, dims["decode_only_efficiency"].high) == \
        perfmodel.AGENTIC_DECODE_ONLY_EFFICIENCY_RANGE
    assert (dims["env_cap_s"].low, dims["env_cap_s"].high) == (60.0, 600.0)
    assert dims["trajectories_per_slot"].choices == (1, 2, 4)
    for d in dims.values():
        assert d.low <= d.fitted <= d.high, d.name
        assert d.low <= fidelity.ROUND_1[d.name] <= d.high, d.name


def test_a_settings_workload_keeps_the_shapes_and_applies_the_caps():
    fitted = fidelity.fitted_setting()
    base = load_scenario(fidelity.BASE).workload
    same = load_scenario(fidelity.BASE, fidelity.workload_overrides(fitted)).workload
    for name in ("turns", "gen_tokens_per_turn", "obs_tokens_per_turn", "env_latency_s"):
        assert getattr(same, name).median == pytest.approx(getattr(base, name).median, rel=1e-5), name
        assert getattr(same, name).p99 == pytest.approx(getattr(base, name).p99, rel=1e-5), name
    moved = load_scenario(fidelity.BASE, fidelity.workload_overrides(
        {**fitted, "turns_mean": 64.0, "gen_tokens_median": 1000.0, "env_mean_s": 4.0, "env_cap_s": 120.0,
         "turns_cap": 40.0, "gen_tokens_cap": 2048.0})).workload
    assert moved.turns.p99 / moved.turns.median == pytest.approx(base.turns.p99 / base.turns.median, rel=1e-5)
    assert moved.turns.median * math.exp(moved.turns.sigma ** 2 / 2) == pytest.approx(64.0, rel=1e-4)
    assert (moved.turns.max, moved.gen_tokens_per_turn.max, moved.env_latency_s.max) == (40.0, 2048.0, 120.0)
    assert moved.gen_tokens_per_turn.median == 1000.0
    assert moved.env_latency_s.median == base.env_latency_s.median
    assert moved.env_latency_s.sigma == pytest.approx(math.sqrt(2 * math.log(4.0 / 1.5)), rel=1e-4)


def test_an_engine_setting_applies_to_the_engine_and_the_prior_and_is_undone_and_its_slots_to_the_scenario():
    from pearl.controlplane.core.domain import Role

    setting = {**fidelity.fitted_setting(), "decode_efficiency": 0.6, "prefill_efficiency": 0.5,
               "decode_only_efficiency": 0.8, "prefill_only_efficiency": 0.4, "turn_prefix_reuse": 0.5,
               "trajectories_per_slot": 4}
    sc = load_scenario(fidelity.BASE)
    before = serving_perf(sc).serving, perfmodel.TURN_PREFIX_REUSE
    with fidelity.engine_setting(setting):
        perf = serving_perf(sc)
        assert perf.serving == perfmodel.ServingEfficiency(0.6, 0.5, 0.8, 0.4)
        assert perf.for_role(Role.DECODE).serving == perfmodel.ServingEfficiency(0.8, 0.5)
        assert perf.for_role(Role.PREFILL).serving == perfmodel.ServingEfficiency(0.6, 0.4)
        assert prior_profile(sc).engine.turn_prefix_reuse == 0.5
    assert (serving_perf(sc).serving, perfmodel.TURN_PREFIX_REUSE) == before
    slots = load_scenario(fidelity.BASE, fidelity.workload_overrides(setting))
    assert slots.training.trajectories_per_slot == 4 and slots.env_slots == slots.workload.batch_size // 4


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


def test_the_paper_reaches_every_target_at_no_loss():
    figs = _paper_figures()
    devs = fidelity.deviations(figs)
    assert len(devs) == 14 and all(d["reached"] and d["distance"] == 0 for d in devs.values())
    assert fidelity.loss(figs) == 0.0
    off = _paper_figures()
    off["fig2b"]["prefill_time_share"] *= 1.5  # half again: 2 scales away
    off["fig2c"]["best_ratio"][48] = "2P6D"  # two prefill workers off
    off["fig2c"]["split_gain"][96] = 0.01  # ahead where the paper is behind
    off["fig2c"]["split_gain"][32] = 0.06  # a smaller lead, but at least +4.9%
    devs = fidelity.deviations(off)
    assert not devs["fig2b.prefill_time_share"]["reached"] and devs["fig2b.prefill_time_share"]["distance"] == 0.5
    assert devs["fig2c.best_ratio.48"]["distance"] == -2 and not devs["fig2c.best_ratio.48"]["reached"]
    assert not devs["fig2c.split_gain.96"]["reached"] and devs["fig2c.split_gain.32"]["reached"]
    assert fidelity.loss(off) == pytest.approx(2.0 ** 2 + 2.0 ** 2 + (0.071 / 0.03) ** 2, abs=1e-3)
    off["fig2c"]["split_gain"][32] = 0.0  # no lead: counted, over its own scale
    assert fidelity.loss(off) == pytest.approx(4 + 4 + (0.071 / 0.03) ** 2 + (0.097 / 0.048) ** 2, abs=1e-3)


def test_the_best_reachable_is_the_closest_setting_with_what_it_leaves_unreached():
    near = _paper_figures()  # the fall reached, Fig. 2b's token share not
    near["fig2b"]["prefill_token_share"] = 0.5
    far = _paper_figures()
    far["fig2a"]["fall_16_24"] = 0.05
    results = [{"setting": {"n": i}, "figures": f} for i, f in enumerate((far, near))]
    best = fidelity.best_reachable(results)
    fall = best["fig2a.fall_16_24"]
    assert fall["best"]["setting"] == {"n": 1} and fall["best"]["unreached"] == ["fig2b.prefill_token_share"]
    assert fall["evaluated"] == 2 and fall["reached_by"] == 1
    del far["fig2c"]  # a setting without Fig. 2c counts for Fig. 2a and 2b only
    assert fidelity.best_reachable(results)["fig2c.split_gain.32"]["evaluated"] == 1


def test_figures_over_seeds_average_the_numbers_and_take_the_commonest_ratio():
    runs = [_paper_figures() for _ in range(3)]
    for run, fall, ratio in zip(runs, (0.02, 0.04, 0.09), ("3P5D", "2P6D", "3P5D"), strict=True):
        run["fig2a"]["fall_16_24"] = fall
        run["fig2c"]["best_ratio"][48] = ratio
    mean = fidelity.mean_figures(runs)
    assert mean["fig2a"]["fall_16_24"] == pytest.approx(0.05)
    assert mean["fig2c"]["best_ratio"][48] == "3P5D"
    assert mean["fig2a"]["rollout_over_training"] == PAPER["fig2a"]["rollout_over_training"]
    assert mean["fig2a"]["makespan_s"] == PAPER["fig2a"]["makespan_s"]


def test_the_model_as_it_is_is_its_own_setting(fig2a, fig2b):
    """The frozen model (the engine's constants, the base scenario's workload) and the setting that
    describes it give the same figures: what the scan evaluated is what runs."""
    figs = fidelity.evaluate(fidelity.fitted_setting(), with_fig2c=False)
    assert figs["fig2a"] == fig2a and figs["fig2b"] == fig2b
