"""`pearlctl dashboard` in a real browser: headless Chromium (Debian's package) loads the page against a
fleet in PostgreSQL, and the test reads what a person sees: the GPU grid's counts are those of
`pearlctl status --json`, and a plan applied during the test appears on the timeline with each of its
steps. A screenshot is saved (`PEARL_TEST_ARTIFACTS`, else the test's temporary directory).

Without Chromium these tests skip, unless PEARL_REQUIRE_CHROMIUM=1 (CI) makes that a failure."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.fleet_status import read_fleet_status
from plan_support import import_cluster, propose, run_plan, small_inventory
from sqlalchemy import Engine, text

pytestmark = pytest.mark.e2e
PEARLCTL = Path(sys.executable).with_name("pearlctl")


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("PEARL_REQUIRE_CHROMIUM") == "1":
            pytest.fail("Chromium is required (PEARL_REQUIRE_CHROMIUM=1): apt-get install chromium")
        pytest.skip("no Chromium (apt-get install chromium)")
    return found


def _browse(url: str, *args: str) -> str:
    """What headless Chromium renders of `url` once its scripts ran (`--dump-dom`), or what it prints."""
    done = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=4000", *args, url],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


class _Seen(HTMLParser):
    """The rendered page as a person reads it: GPU cells by state, the legend's counts, timeline steps."""

    def __init__(self) -> None:
        super().__init__()
        self.gpus: Counter[str] = Counter()
        self.legend: dict[str, int] = {}
        self.steps: dict[str, str] = {}
        self.body: dict[str, str] = {}
        self.plan: str | None = None
        self._legend_state: str | None = None
        self._in_count = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "body":
            self.body = a
        elif tag == "span" and "gpu" in classes:
            self.gpus[a["data-state"]] += 1
        elif tag == "li" and "data-state" in a:
            self._legend_state = a["data-state"]
        elif tag == "b" and "count" in classes:
            self._in_count = True
        elif tag == "div" and "step" in classes:
            self.steps[a["data-key"]] = a["data-status"]
        elif tag == "span" and a.get("id") == "plan-id":
            self.plan = a["data-plan"]

    def handle_data(self, data: str) -> None:
        if self._in_count and self._legend_state is not None:
            self.legend[self._legend_state] = int(data)
            self._in_count, self._legend_state = False, None


def _seen(url: str) -> _Seen:
    seen = _Seen()
    seen.feed(_browse(url, "--dump-dom"))
    assert seen.body.get("data-loaded") == "1", "the page never drew the fleet"
    return seen


@pytest.fixture
def dashboard(db_engine: Engine, database_url: str, tmp_path: Path) -> Iterator[str]:
    _chromium()
    import_cluster(db_engine, small_inventory())
    yield from _serve(database_url, tmp_path, "127.0.0.1")


def _serve(database_url: str, home: Path, host: str) -> Iterator[str]:
    env = {**os.environ, "PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(home)}
    proc = subprocess.Popen([str(PEARLCTL), "dashboard", "--port", "0", "--host", host], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        assert line.startswith("dashboard on http://"), line + proc.stderr.read()  # type: ignore[union-attr]
        yield line.split()[2].split("?")[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        proc.stderr.close()  # type: ignore[union-attr]
        assert code == 0  # a clean stop on SIGTERM


def test_the_page_shows_the_fleet_and_a_plan_applied_meanwhile(dashboard: str, db_engine: Engine,
                                                                tmp_path: Path) -> None:
    status = read_fleet_status(db_engine)
    seen = _seen(dashboard)
    assert dict(seen.gpus) == status["gpus"]["by_state"]  # every GPU a cell, coloured by its state
    assert seen.legend == status["gpus"]["by_state"]
    assert seen.body["data-state-version"] == str(status["state_version"])
    assert seen.plan is None and seen.steps == {}

    plan_id = propose(db_engine)  # a plan applied while the page is open
    plan_store.apply(db_engine, plan_id)
    run_plan(db_engine, datetime.now(UTC))
    status = read_fleet_status(db_engine)
    seen = _seen(dashboard)
    assert seen.plan == str(plan_id)
    with db_engine.connect() as conn:
        keys = set(conn.execute(text("SELECT key FROM plan_steps WHERE plan_id = :p"), {"p": plan_id}).scalars())
    assert keys and set(seen.steps) == keys  # every step of it on the timeline ...
    assert set(seen.steps.values()) == {"succeeded"}  # ... as it ended
    assert dict(seen.gpus) == status["gpus"]["by_state"]

    artifacts = Path(os.environ.get("PEARL_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "dashboard.png"
    _browse(dashboard, "--window-size=1400,1000", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_bound_beyond_localhost_it_needs_the_control_token(db_engine: Engine, database_url: str,
                                                           tmp_path: Path) -> None:
    from pearl.controlplane.store.secrets import control_token

    import_cluster(db_engine, small_inventory())
    for url in _serve(database_url, tmp_path, "127.0.0.2"):  # not `localhost`: as if exposed
        assert httpx.get(url + "api/state", timeout=10).status_code == 401
        assert httpx.get(url, timeout=10).status_code == 401
        token = control_token(db_engine)
        assert httpx.get(url + "api/state", params={"token": "x" * 64}, timeout=10).status_code == 401
        body = httpx.get(url + "api/state", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
        assert body["state_version"] == read_fleet_status(db_engine)["state_version"]
        assert httpx.get(url, params={"token": token}, timeout=10).status_code == 200
