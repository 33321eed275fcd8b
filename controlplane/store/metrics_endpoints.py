"""Where each live pearl process serves `/metrics`, as rows of `metrics_endpoints` (migration 0011).

A process started with `--metrics-port` registers its URL (`register`, which also prunes rows silent
for `PRUNE_S`: processes killed before they could delete theirs), heartbeats it every `HEARTBEAT_S`
and deletes it when it stops. `live` lists those heard from within `SILENT_S`: what `pearlctl status
--json` gives under `metrics`, so that Prometheus can be pointed at the database's view of the fleet.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pearl.controlplane.errors import PearlError
from pearl.controlplane.store.db import transaction
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

log = logging.getLogger("pearl.metrics")
HEARTBEAT_S = 5.0
SILENT_S = 20.0  # a row not heartbeated this long is not listed (its process is gone)
PRUNE_S = 3600.0  # ... and one silent this long is deleted by the next registration
COMPONENTS = ("agent", "loop", "frontdoor", "worker")


def register(engine: Engine, *, component: str, node: str | None, url: str, host: str, pid: int) -> None:
    """This process (`host`, `pid`) serves `component`'s metrics at `url` (a restart in place keeps its row)."""
    with transaction(engine) as session:
        session.execute(text(
            "DELETE FROM metrics_endpoints WHERE heartbeat_at < pearl_now() - make_interval(secs => :prune)"),
            {"prune": PRUNE_S})
        session.execute(text(
            "INSERT INTO metrics_endpoints (component, node, url, host, pid) VALUES (:c, :n, :u, :h, :p) "
            "ON CONFLICT (host, pid, component) DO UPDATE SET node = excluded.node, url = excluded.url, "
            "started_at = pearl_now(), heartbeat_at = pearl_now()"),
            {"c": component, "n": node, "u": url, "h": host, "p": pid})


def heartbeat(engine: Engine, *, component: str, host: str, pid: int) -> bool:
    """The row is still there and now fresh; False when it is gone (deleted: register again)."""
    with transaction(engine) as session:
        return session.execute(text(
            "UPDATE metrics_endpoints SET heartbeat_at = pearl_now() "
            "WHERE host = :h AND pid = :p AND component = :c"), {"c": component, "h": host, "p": pid}).rowcount == 1


def remove(engine: Engine, *, component: str, host: str, pid: int) -> None:
    with transaction(engine) as session:
        session.execute(text("DELETE FROM metrics_endpoints WHERE host = :h AND pid = :p AND component = :c"),
                        {"c": component, "h": host, "p": pid})


def live(session: Session) -> list[dict[str, Any]]:
    """`{component, node, url}` of every process heard from within `SILENT_S`, by component, node, URL."""
    rows = session.execute(text(
        "SELECT component, node, url FROM metrics_endpoints "
        "WHERE heartbeat_at > pearl_now() - make_interval(secs => :silent) ORDER BY component, node, url"),
        {"silent": SILENT_S}).mappings()
    return [dict(r) for r in rows]


class Keeper:
    """Keeps this process's row while it runs: registers it (again after a database blip, or when the
    row was pruned), heartbeats it every `HEARTBEAT_S` from a thread of its own, and deletes it at
    `stop()`. The database away only delays the row; the metrics are served all the while."""

    def __init__(self, engine: Engine, *, component: str, node: str | None, url: str, host: str, pid: int,
                 every_s: float = HEARTBEAT_S) -> None:
        self.engine = engine
        self.row = {"component": component, "node": node, "url": url, "host": host, "pid": pid}
        self.every_s = every_s
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{component}", daemon=True)

    def start(self) -> Keeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        who = {k: self.row[k] for k in ("component", "host", "pid")}
        while not self._stop.is_set():
            try:
                if not (self.registered.is_set() and heartbeat(self.engine, **who)):
                    register(self.engine, **self.row)
                    self.registered.set()
            except PearlError as exc:  # the database away: try again at the next beat
                log.warning("metrics endpoint %s: %s", self.row["url"], exc)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        try:
            remove(self.engine, **{k: self.row[k] for k in ("component", "host", "pid")})
        except PearlError as exc:  # its heartbeat stops: it is no longer listed after SILENT_S
            log.warning("could not remove metrics endpoint %s: %s", self.row["url"], exc)
