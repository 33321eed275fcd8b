"""Wake-ups by LISTEN/NOTIFY: a hint that rows changed, never the truth (the readers poll too).

Channels: `pearl_steps_<node id>` (`step_channel`; payload: the node id, one of whose steps became
ready: each agent hears its own node's steps only), `pearl_plans` ("<plan id>:<status>"),
`pearl_signals` (the table the trainer, the rollout or the provider wrote to).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import psycopg
from pearl.controlplane.store.db import connect_args, count_error
from sqlalchemy import Engine

log = logging.getLogger("pearl.notifications")


def step_channel(node_id: int) -> str:
    """The channel on which the steps of node `node_id` that become ready are announced."""
    return f"pearl_steps_{int(node_id)}"


def listen(engine: Engine, channels: Iterable[str], on_notify: Callable[[str, str], None],
           stop: threading.Event, on_listening: Callable[[], None] | None = None) -> None:
    """Call `on_notify(channel, payload)` for each notification until `stop` is set; reconnects with
    backoff when the connection drops (run it in a thread of its own). `on_listening()` runs each
    time the channels are listened to: at the start and after a reconnect, when notifications may
    have been missed and the caller should look at the rows again."""
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    backoff = 0.5
    while not stop.is_set():
        try:
            with psycopg.connect(url, autocommit=True, **connect_args(url)) as conn:
                for channel in channels:
                    conn.execute(f"LISTEN {channel}")
                backoff = 0.5
                if on_listening is not None:
                    on_listening()
                while not stop.is_set():
                    for note in conn.notifies(timeout=1.0):
                        on_notify(note.channel, note.payload)
        except psycopg.Error as exc:
            count_error(exc)
            log.debug("listener: %s", exc)
            stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)
