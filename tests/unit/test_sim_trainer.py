"""The RL framework's loop: batch creation (async and sync), staleness, the order of steps, late returns."""

from __future__ import annotations

import pytest
from pearl.sim.scenario import Training
from pearl.sim.trainer import Trainer

pytestmark = pytest.mark.unit


def _created_now(tr: Trainer) -> list[int]:
    out = []
    while tr.can_create():
        out.append(tr.create())
    return out


def test_async_staleness_one_keeps_two_batches_open_and_never_runs_two_ahead():
    tr = Trainer(Training(step_s=70, staleness=1, weight_sync_s=2))
    assert _created_now(tr) == [0, 1]  # ROLL creates ratio + 1 groups per environment group at the start
    assert tr.rolling and tr.rollout_step == 0
    tr.finish_rollout()  # batch 0 complete: batch 1, already running, is the one under way
    assert tr.rollout_step == 1 and _created_now(tr) == []  # batch 2 needs the weights of step 0
    assert tr.wants_to_train() and tr.start_training(100.0) == 170.0
    tr.finish_rollout()  # batch 1 complete while step 0 trains: nothing under way
    assert not tr.rolling and tr.rollout_step == 1
    assert not tr.wants_to_train()  # step 0 still running
    assert tr.finish_training(170.0) == 1
    assert _created_now(tr) == [] and not tr.wants_to_train()  # the new weights are not in place yet
    tr.finish_update(172.0)
    assert _created_now(tr) == [2]  # the update after a step creates the batch staleness + 1 ahead of it
    assert tr.wants_to_train() and tr.rollout_step == 2 and tr.ready_at == 172.0


def test_async_staleness_two_runs_up_to_three_batches_ahead_of_training():
    tr = Trainer(Training(step_s=10, staleness=2))
    assert _created_now(tr) == [0, 1, 2]
    tr.finish_rollout()
    tr.start_training(0.0)
    tr.finish_training(10.0)
    tr.finish_update(10.0)
    assert _created_now(tr) == [3]


def test_sync_is_a_per_batch_barrier():
    tr = Trainer(Training(step_s=10, staleness=1, batching="sync"))
    assert _created_now(tr) == [0]
    tr.finish_rollout()
    assert _created_now(tr) == [1]  # the previous batch complete, its weights one step stale at most
    tr.start_training(0.0)
    tr.finish_rollout()
    assert _created_now(tr) == []  # batch 2 needs step 0's weights
    tr.finish_training(10.0)
    tr.finish_update(10.0)
    assert _created_now(tr) == [2]


def test_staleness_zero_is_synchronous_in_either_mode():
    for batching in ("async", "sync"):
        tr = Trainer(Training(step_s=10, staleness=0, batching=batching))
        assert _created_now(tr) == [0]
        tr.finish_rollout()
        assert _created_now(tr) == []
        tr.start_training(0.0)
        tr.finish_training(10.0)
        tr.finish_update(10.0)
        assert _created_now(tr) == [1]


def test_a_late_return_delays_the_step_and_is_counted():
    tr = Trainer(Training(step_s=10))
    tr.create()
    tr.finish_rollout()
    tr.wanted_since = 50.0  # borrowed GPUs still out
    tr.start_training(53.5)
    assert (tr.late_returns, tr.lateness_s) == (1, 3.5)
    assert tr.wanted_since is None


def test_the_loop_is_a_scenario_key_and_refuses_unknown_modes():
    from pearl.controlplane.errors import BadInput
    from pearl.sim.scenario import load_scenario

    sc = load_scenario("paper-qwen3-8b-seg2", ["training.batching=sync", "training.weight_update=abort"])
    assert (sc.training.batching, sc.training.weight_update) == ("sync", "abort")
    for key in ("training.batching=barrier", "training.weight_update=drop"):
        with pytest.raises(BadInput, match=key.split("=")[0]):
            load_scenario("paper-qwen3-8b-seg2", [key])
