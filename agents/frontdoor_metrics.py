"""The front door's Prometheus series, and its routers' re-exported.

Read from the front door at each scrape: requests served, failed and resubmitted (counters since it
started), held and in flight now, the mode it serves, whether each child router can serve. Each child
`sglang-router` serves its own metrics on a port of its own that changes when it is restarted; the
front door fetches them at each scrape and re-exports every sample with the label `router_mode`
(colocated or split), so one scrape target covers the three processes. A child that does not answer
in `CHILD_TIMEOUT_S` is left out of that scrape (`pearl_frontdoor_router_scrape_ok{router_mode} 0`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pearl.agents.router import FrontDoor

CHILD_TIMEOUT_S = 2.0


class FrontDoorCollector(Collector):
    def __init__(self, door: FrontDoor) -> None:
        self.door = door

    def collect(self) -> Iterator[Metric]:
        door = self.door
        requests = CounterMetricFamily("pearl_frontdoor_requests", "Requests answered since the front door "
                                       "started, by outcome (served; failed: refused or given up on).",
                                       labels=["outcome"])
        requests.add_metric(["served"], door.served)
        requests.add_metric(["failed"], door.failed)
        yield requests
        yield CounterMetricFamily("pearl_frontdoor_resubmissions", "Attempts sent again (interrupted or dropped by "
                                  "their worker), the tokens generated so far kept.", door.resubmits)
        yield GaugeMetricFamily("pearl_frontdoor_requests_held", "Requests waiting for a worker of the current "
                                "mode now.", door.held)
        yield GaugeMetricFamily("pearl_frontdoor_requests_in_flight", "Requests in flight now.", door.inflight)
        mode = GaugeMetricFamily("pearl_frontdoor_mode", "1 for the mode new requests go to.", labels=["mode"])
        ready = GaugeMetricFamily("pearl_frontdoor_router_ready", "1 while the mode's router has the workers to "
                                  "serve (a regular one; a prefill and a decode one).", labels=["router_mode"])
        workers = GaugeMetricFamily("pearl_frontdoor_router_workers", "Workers registered with each router.",
                                    labels=["router_mode"])
        for name, child in door.children.items():
            mode.add_metric([name], 1 if name == door.mode else 0)
            ready.add_metric([name], 1 if child.ready() else 0)
            workers.add_metric([name], len(child.workers))
        yield mode
        yield ready
        yield workers
        yield from self._children()

    def _children(self) -> Iterator[Metric]:
        ok = GaugeMetricFamily("pearl_frontdoor_router_scrape_ok", "1 when the router's own metrics were read for "
                               "this scrape (re-exported with `router_mode`).", labels=["router_mode"])
        families: dict[str, Metric] = {}
        for name, child in list(self.door.children.items()):
            try:
                body = httpx.get(f"http://127.0.0.1:{child.prometheus_port}/metrics", timeout=CHILD_TIMEOUT_S).text
                parsed = list(text_string_to_metric_families(body))
            except (httpx.HTTPError, ValueError):  # restarting, or not up yet
                ok.add_metric([name], 0)
                continue
            ok.add_metric([name], 1)
            for family in parsed:
                into = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                               family.unit))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "router_mode": name}, sample.value,
                                    sample.timestamp)
        yield ok
        yield from families.values()
