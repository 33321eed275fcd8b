"""The simulated engine against docs/calibration.md's measured serving figures, within 25%.

One figure, the prefill share of time, lands outside and is pinned as a strict expected failure
with the reason: it is the token share's odds times the per-token cost ratio, and the token share
depends on the paper's unpublished generation lengths; both factors are checked on their own.
The engine's calibration is fixed (sim/calibration.py, controlplane/core/perfmodel.py); it is never
tuned to a throughput target.
"""

from __future__ import annotations

import pytest
from pearl.sim import calibration

pytestmark = pytest.mark.unit

TOLERANCE = 0.25


@pytest.fixture(scope="module")
def agentic():
    return calibration.agentic_colocated()


@pytest.fixture(scope="module")
def sharegpt():
    return calibration.sharegpt_saturation()


def _within(achieved: float, measured: float) -> None:
    assert abs(achieved / measured - 1) <= TOLERANCE, f"{achieved:.4g} vs measured {measured:.4g}"


def test_decode_at_batch_1():
    _within(calibration.decode_batch1_ms(), 7.06)


def test_prefill_of_8k_prompts():
    _within(calibration.prefill_8k_tokens_per_s(), 27_700)


def test_agentic_decode_rate_at_batch_32(agentic):
    _within(agentic["decode_tok_s_per_gpu"], 400)


def test_agentic_prefill_share_of_tokens(agentic):
    _within(agentic["prefill_token_share"], 0.967)


def test_agentic_prefill_cost_per_token_relative_to_decode(agentic):
    _within(agentic["prefill_cost_ratio"], calibration.PEARL_PREFILL_COST_RATIO)


def test_sharegpt_saturation(sharegpt):
    output, total = sharegpt
    _within(output, 10_897)
    _within(total, 24_023)


@pytest.mark.xfail(strict=True, reason=(
    "lands at ~16% vs 26.5%: the share depends on the token mix, and the paper's generation lengths are not "
    "published; at our mix (94% prefill tokens) the per-token cost ratio the paper implies gives 16%, which "
    "test_agentic_prefill_cost_per_token_relative_to_decode checks"))
def test_agentic_prefill_share_of_time(agentic):
    _within(agentic["prefill_time_share"], 0.265)


def test_the_sharegpt_load_has_the_measured_token_means():
    prompts, outputs = calibration.sharegpt_lengths()
    assert prompts.mean() == pytest.approx(calibration.SHAREGPT_INPUT_MEAN, rel=0.05)
    assert outputs.mean() == pytest.approx(calibration.SHAREGPT_OUTPUT_MEAN, rel=0.05)
    assert prompts.max() <= 1024 and (prompts + outputs).max() <= 2048
