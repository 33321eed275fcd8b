"""Each component's `/metrics` page: its own series and no other component's, Prometheus's naming
conventions, a free port by default, and a clear refusal of a port that is taken."""

from __future__ import annotations

import socket

import pytest
from metrics_support import check_conventions, scrape, value
from pearl.cli.metrics import start_metrics
from pearl.controlplane.errors import BadInput
from pearl.controlplane.services import metrics
from pearl.policies.live.loop import _count
from pearl.policies.live.tick import TickResult

pytestmark = pytest.mark.unit

OWN = {"agent": "pearl_step_claims", "loop": "pearl_policy_passes", "worker": "pearl_weight_syncs"}


@pytest.mark.parametrize("component", sorted(OWN))
def test_each_component_serves_its_own_series_and_no_other_components(component: str) -> None:
    server = metrics.serve(component, 0)
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/metrics")
        families = scrape(server.url)
        assert OWN[component] in families
        assert {c for c, name in OWN.items() if name in families} == {component}
        assert "process_cpu_seconds" in families  # the process's own series too
        assert not [n for n in families if n.endswith("_created")]
        assert check_conventions(families) == []
    finally:
        server.stop()


def test_an_agent_page_counts_what_the_agent_did() -> None:
    server = metrics.serve("agent", 0)
    try:
        before = scrape(server.url)
        metrics.STEP_CLAIMS.inc()
        metrics.STEPS.labels("start", "succeeded").inc()
        metrics.STEP_SECONDS.labels("start", "succeeded").observe(3.0)
        after = scrape(server.url)
        assert value(after, "pearl_step_claims_total") == value(before, "pearl_step_claims_total") + 1
        assert value(after, "pearl_steps_total", action="start", outcome="succeeded") == \
            value(before, "pearl_steps_total", action="start", outcome="succeeded") + 1
        assert after["pearl_step_duration_seconds"].type == "histogram"
        assert value(after, "pearl_step_duration_seconds_bucket", action="start", le="5.0") >= 1
    finally:
        server.stop()


def test_a_policy_pass_is_counted_by_outcome_and_its_decision_by_mode() -> None:
    registry = metrics.registry_for("loop")
    decided = {"target": {"mode": "split"}, "predicted_current_s": 700.0, "predicted_target_s": 650.0}
    splits = registry.get_sample_value("pearl_policy_decisions_total", {"mode": "split"}) or 0
    followed = registry.get_sample_value("pearl_policy_passes_total", {"outcome": "following"}) or 0
    _count(TickResult(True, "decided", decision=decided), 0.02)
    _count(TickResult(False, "another leads", leading=False), 0.001)
    assert registry.get_sample_value("pearl_policy_decisions_total", {"mode": "split"}) == splits + 1
    assert registry.get_sample_value("pearl_policy_passes_total", {"outcome": "following"}) == followed + 1
    assert registry.get_sample_value("pearl_policy_predicted_makespan_seconds", {"configuration": "target"}) == 650.0
    assert registry.get_sample_value("pearl_policy_leading") == 0


def test_a_port_taken_is_refused_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BadInput, match="--metrics-port"):
            start_metrics(None, "agent", port)


def test_no_port_serves_nothing() -> None:
    assert start_metrics(None, "agent", None)() is None


def test_an_unknown_component_is_refused() -> None:
    with pytest.raises(ValueError, match="component"):
        metrics.registry_for("scheduler")
