"""A claimed step's context: why a handler stops is decided by the first reason given."""

from __future__ import annotations

import pytest
from pearl.agents.steps import StepCancelled, StepContext

pytestmark = pytest.mark.unit


def _ctx() -> StepContext:
    return StepContext(engine=None, step={"id": 1, "key": "w1.start", "fence": 7}, driver=None,  # type: ignore[arg-type]
                       client=None, front_door=None, node_address="127.0.0.1", actor="test")  # type: ignore[arg-type]


@pytest.mark.parametrize("first", ["plan", "claim"])
def test_a_shutdown_after_the_plan_stopped_or_the_claim_was_lost_keeps_that_reason(first: str) -> None:
    ctx = _ctx()
    ctx.check()  # not cancelled: nothing raised
    ctx.stop(first)
    ctx.stop("shutdown")  # the agent's SIGTERM grace ran out after its heartbeat saw the first
    with pytest.raises(StepCancelled) as raised:
        ctx.check()
    assert raised.value.reason == first and ctx.cancel_reason == first


def test_a_shutdown_alone_hands_the_step_back() -> None:
    ctx = _ctx()
    ctx.stop("shutdown")
    with pytest.raises(StepCancelled, match="step w1.start stops: shutdown"):
        ctx.check()
