"""Reading a process's `/metrics` as Prometheus would, and holding it to Prometheus's conventions."""

from __future__ import annotations

import re
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
# labels that would make a series per object: unbounded sets, never a label of pearl's
UNBOUNDED = {"id", "worker", "worker_id", "step", "step_id", "plan", "plan_id", "url", "endpoint", "pid", "host"}


def scrape(url: str) -> dict[str, Any]:
    """The families of one scrape, by name (counters without their `_total`)."""
    resp = httpx.get(url, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    """The sum of the samples named `sample` whose labels include `labels` (0 when none)."""
    family = families[_family_of(families, sample)]
    return sum(s.value for s in family.samples if s.name == sample and labels.items() <= s.labels.items())


def _family_of(families: dict[str, Any], sample: str) -> str:
    for suffix in ("_total", "_bucket", "_count", "_sum", ""):
        name = sample.removesuffix(suffix) if suffix else sample
        if sample.endswith(suffix) and name in families:
            return name
    raise AssertionError(f"no family for {sample} in {sorted(families)}")


def check_conventions(families: dict[str, Any], prefix: str = "pearl_") -> list[str]:
    """What breaks Prometheus's naming conventions among the `prefix` families: counters end in
    `_total`, durations are in seconds, names are snake_case, every family has help, labels are bounded."""
    problems = []
    for name, family in families.items():
        if not name.startswith(prefix):
            continue
        if not NAME.match(name):
            problems.append(f"{name}: not snake_case")
        if not family.documentation:
            problems.append(f"{name}: no HELP")
        if ("duration" in name or "lateness" in name or "makespan" in name) and "_seconds" not in name:
            problems.append(f"{name}: a time not in seconds")
        for s in family.samples:
            if family.type == "counter" and not s.name.endswith("_total"):
                problems.append(f"{s.name}: a counter sample without _total")
            if UNBOUNDED & s.labels.keys():
                problems.append(f"{s.name}: unbounded label {sorted(UNBOUNDED & s.labels.keys())}")
    return problems
