"""Where the front door's routers and the rows disagree (controlplane/core/routing.py)."""

from __future__ import annotations

import pytest
from pearl.agents.router_client import listed_workers
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.routing import routing_drift

pytestmark = pytest.mark.unit

SERVING = [(1, "http://a:1", Role.PREFILL), (2, "http://a:2", Role.DECODE), (3, "http://b:1", Role.COLOCATED)]


def test_a_serving_worker_listed_under_another_role_or_not_at_all_is_missing_and_a_stranger_is_named() -> None:
    listed = {("http://a:1", Role.PREFILL), ("http://a:2", Role.PREFILL), ("http://c:9", Role.COLOCATED)}
    missing, unknown = routing_drift(listed, SERVING)
    assert missing == [SERVING[1], SERVING[2]]  # worker 2 listed as prefill, worker 3 not at all
    assert unknown == ["http://c:9"]
    assert routing_drift({(e, r) for _, e, r in SERVING}, SERVING) == ([], [])


def test_the_front_doors_state_gives_what_its_routers_list_or_nothing_when_a_router_cannot_say() -> None:
    state = {"children": {
        "colocated": {"error": None, "workers": [{"url": "http://b:1", "worker_type": "regular"}]},
        "split": {"error": None, "workers": [{"url": "http://a:1", "worker_type": "prefill"},
                                             {"url": "http://a:2", "worker_type": "decode"}]}}}
    assert listed_workers(state) == {(e, r) for _, e, r in SERVING}
    state["children"]["split"] = {"error": "connection refused", "workers": []}
    assert listed_workers(state) is None  # its list would look empty: every split worker "missing"
