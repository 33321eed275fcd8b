"""Prometheus metrics of pearl's long-running processes, and the HTTP server that exposes them.

Each process started with `--metrics-port P` (0: a free port) serves `/metrics` in Prometheus's text
format on localhost (`PEARL_METRICS_HOST` to bind elsewhere): the series of its component below, the
process's own (`process_*`, `python_*`), and the collectors it adds (the front door's, the fleet's
read from the database by the policy loop). Names follow Prometheus's conventions: the unit in the
name (`_seconds`), `_total` for counters, and labels over small fixed sets (step actions, outcomes,
modes, roles, zones, states), never ids or URLs.

The metrics are defined once here, unregistered; `serve` registers those of one component in a
registry of its own, so an agent's page carries no empty policy series.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

# step actions take from well under a second (a router sync) to minutes (a cold start)
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
SYNC_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _unregistered(kind: type, name: str, doc: str, labels: Iterable[str] = (), **kwargs: Any) -> Any:
    return kind(name, doc, labelnames=tuple(labels), registry=None, **kwargs)


# -- the node agent -------------------------------------------------------------------------------
STEP_CLAIMS = _unregistered(Counter, "pearl_step_claims", "Plan steps this agent claimed.")
STEPS = _unregistered(Counter, "pearl_steps", "Plan steps this agent ended, by action and outcome (succeeded, "
                      "failed, cancelled, handed_back, claim_lost).", ("action", "outcome"))
STEP_SECONDS = _unregistered(Histogram, "pearl_step_duration_seconds",
                             "From claim to report of the steps this agent ended, by action and outcome.",
                             ("action", "outcome"), buckets=STEP_BUCKETS)
STEPS_IN_HAND = _unregistered(Gauge, "pearl_steps_in_hand", "Steps this agent holds claimed now.")
STEP_DB_RETRIES = _unregistered(Counter, "pearl_step_database_retries",
                                "Step handlers run again after the database was away or gave up on a statement.")
RESCUES = _unregistered(Counter, "pearl_step_rescues",
                        "Steps of lost claims (their lease ran out) the reaper in this agent gave to the next claim.")
REAPED_PLANS = _unregistered(Counter, "pearl_reaper_failed_plans",
                             "Plans the reaper in this agent failed (a step out of attempts).")
AGENT = (STEP_CLAIMS, STEPS, STEP_SECONDS, STEPS_IN_HAND, STEP_DB_RETRIES, RESCUES, REAPED_PLANS)

# -- the policy loop ------------------------------------------------------------------------------
PASS_SECONDS = _unregistered(Histogram, "pearl_policy_pass_duration_seconds",
                             "Policy passes this loop ran as the leader.", buckets=PASS_BUCKETS)
PASSES = _unregistered(Counter, "pearl_policy_passes", "Policy passes by outcome (decided: a decision written; "
                       "unchanged; following: another loop leads; failed).", ("outcome",))
DECISIONS = _unregistered(Counter, "pearl_policy_decisions", "Decisions by the mode of their target (colocated, "
                          "split; none: the mode kept).", ("mode",))
PREDICTED = _unregistered(Gauge, "pearl_policy_predicted_makespan_seconds",
                          "The last decision's predicted rollout makespan of the current and of the target "
                          "configuration.", ("configuration",))
LEADING = _unregistered(Gauge, "pearl_policy_leading", "1 while this loop holds the policy leader lease.")
LOOP = (PASS_SECONDS, PASSES, DECISIONS, PREDICTED, LEADING)

# -- the weight-sync worker -----------------------------------------------------------------------
SYNCS = _unregistered(Counter, "pearl_weight_syncs",
                      "Weight-sync tasks by outcome (done, skipped, failed; error: the task raised).", ("outcome",))
SYNC_SECONDS = _unregistered(Histogram, "pearl_weight_sync_duration_seconds",
                             "Weight-sync tasks from start to outcome.", ("outcome",), buckets=SYNC_BUCKETS)
SYNCS_RUNNING = _unregistered(Gauge, "pearl_weight_syncs_running", "Weight-sync tasks running now.")
WORKER = (SYNCS, SYNC_SECONDS, SYNCS_RUNNING)

COMPONENTS: dict[str, tuple[Any, ...]] = {"agent": AGENT, "loop": LOOP, "worker": WORKER, "frontdoor": ()}


def metrics_host() -> str:
    return os.environ.get("PEARL_METRICS_HOST", "").strip() or "127.0.0.1"


@dataclass
class MetricsServer:
    """`/metrics` of one component, served by a thread of prometheus_client's HTTP server."""

    component: str
    url: str
    registry: CollectorRegistry
    _server: Any = field(repr=False, default=None)
    _thread: threading.Thread | None = field(repr=False, default=None)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)


def registry_for(component: str, extra: Iterable[Collector] = ()) -> CollectorRegistry:
    """A registry of `component`'s metrics, the process's own and `extra` collectors."""
    if component not in COMPONENTS:
        raise ValueError(f"component: one of {', '.join(COMPONENTS)}, not {component!r}")
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    for collector in (*COMPONENTS[component], *extra):
        registry.register(collector)
    return registry


def serve(component: str, port: int, extra: Iterable[Collector] = (), host: str | None = None) -> MetricsServer:
    """Serve `component`'s registry on `host:port` (0: a free port); its URL names the bound port. An
    OSError (the port taken) goes to the caller."""
    host = host or metrics_host()
    disable_created_metrics()  # no `_created` series beside each counter and histogram
    registry = registry_for(component, extra)
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return MetricsServer(component, f"http://{shown}:{bound}/metrics", registry, server, thread)
