"""`pearlctl demo` as a newcomer runs it: every process of the live system, on the embedded services,
then nothing left behind; and Ctrl-C at any moment leaves nothing behind either."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
from pearl.agents.drivers.process import every_process
from plan_support import PEARLCTL, REPO

pytestmark = pytest.mark.e2e


@pytest.fixture
def home() -> Iterator[Path]:
    """The demo's PEARL_HOME, outside pytest's temporary root: pytest resets that root to mode 0700
    whenever another session starts, and the embedded PostgreSQL (run as the `pgserver` user under
    root) must still reach its data to be stopped."""
    path = Path(tempfile.mkdtemp(prefix="pearl-demo-test-"))
    path.chmod(0o755)
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARL_")}
    env["PEARL_HOME"] = str(home)
    return env


def _leftovers(home: Path) -> list[str]:
    """Processes that belong to this demo (their command line or working directory is under its home)."""
    found = []
    for p in every_process(["cmdline", "cwd"]):
        try:
            where = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
        except (psutil.Error, TypeError):
            continue
        if str(home) in where and p.pid != os.getpid():
            found.append(f"{p.pid}: {where[:200]}")
    return found


def _demo(home: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(PEARLCTL), "demo", *args], env=_env(home), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_short_demo_runs_the_whole_system_and_leaves_nothing_behind(tmp_path: Path, home: Path) -> None:
    # two training steps, however long a loaded machine takes over them (the second's rollout serves
    # the weights the first wrote)
    # at 20x the scenario's 30 s revocation notice is 1.5 wall seconds, less than a pass, a drain, an
    # interrupt and a release take on a 2-core machine running other tests; 120 s (6 wall s) was late in
    # CI and here while the suite's other workers started their nodes. 600 s is 30 wall seconds, a
    # provider's 30 s notice in wall time (tests/e2e/test_live_events.py holds a release to 30 s too)
    demo = _demo(home, "--steps", "2", "--duration", "3000", "--speed", "20", "--json", "--no-simulate",
                 "--plot", str(tmp_path / "demo.png"), "--set", "cluster.preemptible.notice_s=600")
    try:
        out, err = demo.communicate(timeout=400)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 0, err[-3000:]
    s = json.loads(out)
    assert s["rollout_steps"] >= 2 and s["training_steps"] == 2 and s["stopped"] is None, (s, err[-3000:])
    assert s["model_s"] < 3000  # the steps ended the run
    assert s["plans_applied"] > 0 and s["weight_syncs"] > 0
    assert s["failed_requests"] == 0 and s["requests"] > 0
    assert s["violations"] == []  # `pearlctl check` over the rows the run left
    assert s["dashboard"].startswith("http://127.0.0.1:") and "dashboard is at" in err
    # all three metrics are reported (not ordered: the window counts the first step's tokens, which the
    # per-step metric and the ratio of sums drop with the first step's duration)
    assert s["tokens_per_s"] > 0 and s["tokens_per_s_ratio_of_sums"] > 0 and s["tokens_per_s_window"] > 0
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert _leftovers(home) == []  # agents, workers, servers, routers, the loop and the embedded servers
    # as the simulator decides its first fleet with the trace's t=0 GPUs in place, the loop's first
    # decision comes after they were granted (read from the rows the demo left behind)
    first_grant, first_decision = _first_grant_and_decision(home, s["database"])
    assert first_grant is not None and first_decision is not None and first_grant < first_decision


def _first_grant_and_decision(home: Path, database: str) -> tuple:
    subprocess.run([str(PEARLCTL), "db", "start"], env=_env(home), check=True, capture_output=True, timeout=120)
    try:
        with psycopg.connect(database) as conn:
            return conn.execute(
                "SELECT (SELECT min(at) FROM events WHERE entity = 'gpus' AND op = 'update'"
                "        AND old->>'state' = 'unavailable' AND new->>'state' = 'free'),"
                "       (SELECT min(created_at) FROM decisions)").fetchone()
    finally:
        subprocess.run([str(PEARLCTL), "db", "stop"], env=_env(home), check=True, capture_output=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_ctrl_c_at_any_moment_leaves_no_process_behind(home: Path, seed: int) -> None:
    delay = random.Random(seed).uniform(1.0, 25.0)  # during the start, the warm-up or the run
    demo = _demo(home, "--duration", "600", "--speed", "10", "--json", "--no-simulate")
    try:
        time.sleep(delay)
        demo.send_signal(signal.SIGINT)
        demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
    assert demo.returncode in (0, 1, 130), demo.returncode
    deadline = time.monotonic() + 10
    while _leftovers(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(home) == [], f"after SIGINT at {delay:.1f} s"


def test_ctrl_c_during_the_run_stops_it_cleanly(home: Path) -> None:
    demo = _demo(home, "--duration", "3000", "--speed", "10", "--json", "--no-simulate")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # wait until it runs: the servers are up
            if any("simworker" in p for p in _leftovers(home)):
                break
            time.sleep(0.5)
        time.sleep(3)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 0, err[-3000:]
    assert json.loads(out)["stopped"] == "interrupted"
    time.sleep(0.5)
    assert _leftovers(home) == []
