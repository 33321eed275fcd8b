"""The simulated engine against docs/calibration.md's measured serving figures, within 25%.

The paper's own prefill shares (Fig. 2b) are part of the calibration set and checked in their
setting by tests/unit/test_fidelity.py. The engine's calibration is fixed (sim/calibration.py,
controlplane/core/perfmodel.py, docs/fidelity.md); it is never tuned to a throughput target.
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


def test_agentic_prefill_share_of_tokens(agentic):
    _within(agentic["prefill_token_share"], 0.967)


def test_sharegpt_saturation(sharegpt):
    output, total = sharegpt
    _within(output, 10_897)
    _within(total, 24_023)


def test_the_sharegpt_load_has_the_measured_token_means():
    prompts, outputs = calibration.sharegpt_lengths()
    assert prompts.mean() == pytest.approx(calibration.SHAREGPT_INPUT_MEAN, rel=0.05)
    assert outputs.mean() == pytest.approx(calibration.SHAREGPT_OUTPUT_MEAN, rel=0.05)
    assert prompts.max() <= 1024 and (prompts + outputs).max() <= 2048
