"""The calibration set (the paper's §3, docs/fidelity.md): every figure within 25% of the paper, or a
strict expected failure whose reason docs/fidelity.md argues."""

from __future__ import annotations

import pytest
from pearl.controlplane.core import perfmodel
from pearl.sim import fidelity

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
