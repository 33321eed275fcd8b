"""The asynchronous trainer: staleness, the order of steps, late returns."""

from __future__ import annotations

import pytest
from pearl.sim.scenario import Training
from pearl.sim.trainer import Trainer

pytestmark = pytest.mark.unit


def test_staleness_one_overlaps_rollout_k_plus_1_with_training_k():
    tr = Trainer(Training(step_s=70, staleness=1, weight_sync_s=2))
    assert tr.can_roll_out() and tr.start_rollout() == 0
    assert not tr.can_roll_out()  # one batch at a time
    tr.finish_rollout()
    assert tr.wants_to_train() and tr.start_training(100.0) == 170.0
    assert tr.can_roll_out() and tr.start_rollout() == 1  # batch 1 on weights 0: one step stale
    tr.finish_rollout()
    assert not tr.wants_to_train()  # step 0 still running
    assert not tr.can_roll_out()  # batch 2 needs the weights of step 0
    assert tr.finish_training(170.0) == 1
    assert tr.can_roll_out() and tr.wants_to_train()


def test_staleness_zero_is_synchronous():
    tr = Trainer(Training(step_s=10, staleness=0))
    tr.start_rollout()
    tr.finish_rollout()
    assert not tr.can_roll_out()
    tr.start_training(0.0)
    tr.finish_training(10.0)
    assert tr.can_roll_out()


def test_a_late_return_delays_the_step_and_is_counted():
    tr = Trainer(Training(step_s=10))
    tr.start_rollout()
    tr.finish_rollout()
    tr.wanted_since = 50.0  # borrowed GPUs still out
    tr.start_training(53.5)
    assert (tr.late_returns, tr.lateness_s) == (1, 3.5)
    assert tr.wanted_since is None
