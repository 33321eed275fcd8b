"""The borrowing gate, the toggle-cost estimate, and the mandatory return."""

from __future__ import annotations

import math

import pytest
from pearl.controlplane.core.domain import Activity, Role, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot
from pearl.controlplane.errors import BadInput
from pearl.policies.base import Signals
from pearl.policies.borrowing import TOGGLE_EMA, ToggleCost, borrowable, gate, toggle_cost_prior

pytestmark = pytest.mark.unit


def _signals(**kw) -> Signals:
    base = dict(now=0.0, event="training_end", rollout_step=3, batch_size=64, remaining=32, training=False,
                training_wanted=False)
    return Signals(**{**base, **kw})


def test_gate_borrows_only_when_the_remaining_gain_beats_the_toggle_cost():
    toggle = ToggleCost(11.5)
    yes = gate(0.5, 200.0, 150.0, toggle)  # 0.5 * 50 = 25 > 11.5
    no = gate(0.1, 200.0, 150.0, toggle)  # 0.1 * 50 = 5 < 11.5
    assert yes.borrow and yes.gain_s == pytest.approx(25.0) and "borrow" in yes.reason
    assert not no.borrow and no.cost_s == 11.5 and "do not borrow" in no.reason
    assert not gate(1.0, 100.0, 120.0, toggle).borrow  # borrowing would not help
    assert gate(1.0, math.inf, 100.0, toggle).borrow  # nothing dedicated: any capacity helps


@pytest.mark.parametrize(("args", "field"), [
    ((1.5, 10.0, 5.0), "remaining_fraction"), ((0.5, math.nan, 5.0), "t_dedicated_s"), ((0.5, 10.0, -1.0), "t_full_s"),
])
def test_gate_refuses_bad_numbers(args, field):
    with pytest.raises(BadInput, match=field):
        gate(*args, ToggleCost(1.0))


def test_toggle_cost_starts_from_the_configured_costs_and_follows_measurements():
    prior = toggle_cost_prior(6.0, 3.5, 2.0)
    assert prior.seconds == 11.5 and prior.measured == 0
    assert prior.update(_signals()) is prior  # nothing measured yet
    one = prior.update(_signals(toggle_costs=(21.5,), toggle_cycles=1))
    assert one.seconds == pytest.approx((1 - TOGGLE_EMA) * 11.5 + TOGGLE_EMA * 21.5) and one.measured == 1
    assert one.update(_signals(toggle_costs=(21.5,), toggle_cycles=1)) == one  # the same cycle is not counted twice
    two = one.update(_signals(toggle_costs=(21.5, 11.5, 11.5), toggle_cycles=3))
    assert two.measured == 3 and two.seconds < one.seconds
    with pytest.raises(BadInput, match="reconfig.toggle_on_s"):
        toggle_cost_prior(-1.0, 3.5, 2.0)


def test_the_return_is_never_optional():
    slots = tuple(WorkerSlot(id=i, node="train-0", gpus=(2 * i, 2 * i + 1), zone=WorkerZone.OVERLAP,
                             role=Role.TRAINING, activity=Activity.INACTIVE) for i in range(3))
    snapshot = FleetSnapshot(1, slots, tp=2)
    assert [w.id for w in borrowable(snapshot, _signals())] == [0, 1, 2]
    assert borrowable(snapshot, _signals(training=True)) == ()
    assert borrowable(snapshot, _signals(training_wanted=True)) == ()
