"""The database benchmarks run end to end in their small versions (`--quick`) and print one JSON object
with the figures they promise: bench/step_claims.py, bench/plan_graph.py, bench/tick_latency.py,
bench/weight_sync.py, bench/scale.py.

bench/step_claims.py and bench/weight_sync.py need the `bench` extra (procrastinate, safetensors);
without it their tests are skipped. Each
runs in a fresh interpreter, as a user runs it, against the test PostgreSQL server
(`--database-url`); the checks are on the keys and on values that can only be sane, never on speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from plan_support import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run_bench(name: str, database_url: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--quick", "--database-url",
                           database_url, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)  # exactly one JSON object
    assert out["bench"] == name and out["quick"] is True
    assert out["machine"]["cpus"] >= 1 and out["database"]["server_version"]
    return out


def sane(stats: dict[str, Any], n: int | None = None) -> None:
    assert 0 < stats["p10_ms"] <= stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    if n is not None:
        assert stats["n"] == n


def test_step_claims(pg_server_url: str) -> None:
    pytest.importorskip("procrastinate", reason="the `bench` extra: pip install -e '.[bench]'")
    out = run_bench("step_claims", pg_server_url)
    assert [c["connections"] for c in out["concurrency"]] == [2, 4]
    for level in out["concurrency"]:
        for side in ("pearl", "procrastinate", "pearl_reported"):
            run = level[side]
            jobs = level["connections"] * run.get("jobs_per_connection", level["jobs_per_connection"])
            assert run["claims"] == jobs and run["claims_per_s"] > 0 and run["wall_s"] > 0
            sane(run["claim"], jobs)
            sane(run["finish"], jobs)
        # one agent per node with its steps all ready: a claim never comes back empty
        assert level["pearl"]["empty_claims"] == 0 and level["pearl_reported"]["empty_claims"] == 0
        assert all(r > 0 for r in level["ratio_pearl_to_procrastinate"].values())
    assert [(b["connections"], b["ready_per_node"]) for b in out["backlog"]] == [(2, 2), (2, 32)]
    assert all(b["pearl"]["claims_per_s_median"] > 0 and b["ratio_claims_per_s"] > 0 for b in out["backlog"])
    wake = out["wakeup"]
    sane(wake["pearl"]["from_apply_call"], 5)
    sane(wake["procrastinate"]["from_insert_call"], 5)
    # from the call's return the wake-up may be at or below zero (the listener hears the commit as soon
    # as the caller does), never later than from the call
    for side, key in (("pearl", "from_apply"), ("procrastinate", "from_insert")):
        after, call = wake[side][f"{key}_commit"], wake[side][f"{key}_call"]
        assert after["n"] == 5 and after["p10_ms"] <= after["p50_ms"] <= after["p99_ms"] <= after["max_ms"]
        assert after["max_ms"] <= call["max_ms"] and after["p50_ms"] <= call["p50_ms"]
    assert wake["ratio_pearl_to_procrastinate"]["p50"] > 0 and wake["ratio_pearl_to_procrastinate"]["p99"] > 0
    assert wake["pearl"]["from_apply_commit"]["max_ms"] < 5000  # woken, not polled (the agents poll every 30 s)


def test_plan_graph(pg_server_url: str) -> None:
    out = run_bench("plan_graph", pg_server_url)
    small, large = out["sizes"]
    for size in (small, large):
        workers = size["gpus"] // 2
        assert size["workers"] == workers and size["target"] == f"{workers // 4}P:{workers - workers // 4}D"
        assert size["steps"] == 6 * workers + 2  # a restart chain each, one barrier, one router sync
        assert size["edges"] == 7 * workers  # 4 in each chain, the barrier's loads, its admits, the sync's admits
        assert size["actions"]["barrier"] == 1 and size["ready_on_apply"] == workers  # the drains
        assert size["write_plan_s"] > 0 and size["apply_s"] > 0
        r = size["reconcile"]
        assert r["status"] == "succeeded" and r["reports"] == r["claims"] == size["steps"] - 1  # not the barrier
        assert r["rounds"] == 7 and r["reports_per_s"] > 0
        sane(r["report"], r["reports"])
    assert large["scaling"]["gpus"] == 2 and large["scaling"]["steps"] > 1.9


def test_tick_latency(pg_server_url: str) -> None:
    out = run_bench("tick_latency", pg_server_url)
    (pass_,) = out["tick"]
    assert pass_["gpus"] == 32 and pass_["outcome"] == ["plan applied"] and pass_["plan_steps"] > 0
    sane(pass_["pass"], 2)
    sane(pass_["baseline_pure_decision"], 2)
    assert pass_["pass"]["p50_ms"] > pass_["baseline_pure_decision"]["p50_ms"]
    assert set(pass_["parts_p50_ms"]) == {"reap", "decide", "write", "apply"}
    assert all(part > 0 for part in pass_["parts_p50_ms"].values())
    (back,) = out["return"]
    assert back["overlap_workers"] == 4 and back["borrowed_gpus"] == 8 and back["repetitions"] == 2
    assert back["release_steps"] == 3 * 4  # drain, interrupt, release for each borrowed worker
    for key in ("return", "trainer_wait", "release_steps_sum", "critical_path"):
        sane(back[key], 2)
    assert back["critical_path"]["max_ms"] <= back["release_steps_sum"]["max_ms"]
    assert back["critical_path"]["p50_ms"] < back["return"]["p50_ms"]


def test_weight_sync(pg_server_url: str) -> None:
    pytest.importorskip("safetensors", reason="the `bench` extra: pip install -e '.[bench]'")
    pytest.importorskip("torch")
    out = run_bench("weight_sync", pg_server_url)
    (size,) = out["throughput"]
    for side in ("snapshot_load", "broadcast"):
        assert size[side]["pearl_checked_mb_per_s"] > 0 and size[side]["ratio_pearl_to_raw"] > 0
    (fleet,) = out["latency"]["redis"]
    assert fleet["servers"] == 2 and 0 < fleet["min_s"] <= fleet["p50_s"] <= fleet["max_s"]


def test_scale(pg_server_url: str) -> None:
    out = run_bench("scale", pg_server_url)
    assert (out["gpus"], out["agents"], out["agent_processes"], out["workers"]) == (64, 4, 2, 32)
    # colocated -> split (6 steps a worker, a barrier and a router sync) and back (the same shape)
    assert out["steps"] == 2 * (6 * 32 + 2)
    assert out["reports"] == out["steps"] - 2  # every step but the two barriers is reported by an agent
    assert out["violations"] == 0 and out["agent_errors"] == [] and out["active_after"] == {"colocated": 32}
    assert out["plan_write_s"] > 0 and out["reconcile_s"] >= max(out["reconcile_each_s"]) > 0
    assert out["reports_per_s"] > 0 and 0 < out["claim_p50_ms"] <= out["claim_p99_ms"]
    sane(out["report"], out["reports"])
    # two connections an agent (claims and reports, NOTIFY) and at most two of the bench's own
    assert 2 * 4 <= out["peak_connections"] <= 2 * 4 + 2 and out["status_json_s"] > 0
