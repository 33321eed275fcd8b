"""The node agent's watch over the servers of its active workers: a server that died is found between
plans, not only by the next step that needs it.

Every pass looks at the node's active workers that no plan step and no weight sync is at work on
(`store.crashes.serving`). A server is down when the driver runs no process for the worker and its
endpoint does not answer `/health` (a server restarted by other means and answering is not down; a
live process that is slow to answer, paused for a weights load say, is not either). Down for
`crash_after_s` in a row, it is crashed: the rows take the worker out of service and free its GPUs
(`store.crashes.mark_crashed`, a compare-and-set on the endpoint and generation seen), then the
front door stops routing to it. The policy plans the capacity back.

A process the driver runs counts as up whatever generation it was launched for: an overlap server
woken for a new loan keeps its process (and its record) while the worker's generation moves on.

A server that answers but serves an older weights version than its row says (restarted by other
means on the same address, with the weights it was launched with) is taken out of service at once
the same way: its row would otherwise claim weights it does not run. (A newer version than the row
is a sync or broadcast whose record is on its way, not a fault.)

Each pass also stops the servers left running under workers out of service (`store.crashes.
out_of_service`): a revoked preemptible GPU whose notice ran out before its plan released it, a
start that failed after its launch. Each is taken off the front door, then stopped only while it is
still the process seen: a start arriving meanwhile replaces it (its generation moved on) and its new
server is never touched. No database lock is held across the stop.

And it registers again with the front door the serving workers it does not list, as a front door
restarted without its run directory comes back with none (`register_missing`, on a thread of its
own so that a slow front door never delays finding a crash). The front door is asked what it lists
(one call, a short timeout, never waiting for a stopped one) whenever a new start of it runs, and
every `relist_s` (jittered) besides: every agent asking it every pass would load the process that
also serves the requests. The rows are read first, the list second, so a worker admitted in
between is not taken for a missing one. A worker is registered again when the driver runs its
server at the endpoint in the rows and that server answers `/health`, with the role and bootstrap
port the driver recorded. A step must never run beside such a registration (a drain could be
undone by it), so the agent holds the worker aside meanwhile (`aside`): not while a step of it is
in hand, and a step claimed for it meanwhile is handed back. Once aside, the rows are read again: a
step that came and went (a drain) has taken the worker out of `serving`, and it is left alone. And
once registered, a worker that left service meanwhile by another way (a notice enforced at its
deadline) is taken off the front door again.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from pearl.agents.drivers.base import Driver, DriverError
from pearl.agents.steps import FrontDoorAPI
from pearl.controlplane.store import crashes
from pearl.controlplane.store.db import transaction

log = logging.getLogger("pearl.agent")


@contextlib.contextmanager
def always_aside(worker_id: int) -> Iterator[bool]:
    """No steps to keep away (a watch used on its own)."""
    yield True


class ServerWatch:
    def __init__(self, engine: Any, node: str, driver: Driver, health: Callable[[str], bool],
                 front_door: Callable[[], FrontDoorAPI], crash_after_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 aside: Callable[[int], contextlib.AbstractContextManager[bool]] = always_aside,
                 relist_s: float = 30.0, served: Callable[[str], int | None] | None = None) -> None:
        self.engine, self.node, self.driver = engine, node, driver
        self.health, self.front_door = health, front_door
        self.crash_after_s = crash_after_s
        self.clock = clock
        self.aside = aside
        self.relist_s = relist_s
        self.served = served  # endpoint -> the weights version its server reports (None: no answer)
        self.down_since: dict[crashes.Serving, float] = {}
        self.door_seen: Any = None  # the start of the front door last asked what it lists
        self.next_relist = 0.0

    def down(self, seen: crashes.Serving) -> bool:
        if self.driver.running(seen.worker_id) is not None:
            return False
        return not self.health(seen.endpoint)

    def stop_leftovers(self) -> list[int]:
        """Stop the servers whose workers are out of service (module docstring); the workers."""
        servers = {s.worker_id: s for s in self.driver.servers()}
        with transaction(self.engine) as session:
            left = crashes.out_of_service(session, self.node, sorted(servers))
        stopped = []
        for wid in left:
            server = servers[wid]
            self._deregister(server.endpoint)  # stopping it is what matters
            if self.driver.stop(wid, pid=server.pid):  # that process only: a start may have replaced it
                log.warning("worker %d is out of service but its server at %s still ran: stopped it", wid,
                            server.endpoint, extra={"action": "stop_leftover_server"})
                stopped.append(wid)
        return stopped

    def check(self) -> list[int]:
        """One pass: the workers it found crashed (and took out of service)."""
        with transaction(self.engine) as session:
            watched = crashes.serving(session, self.node)
        now = self.clock()
        self.down_since = {s: t for s, t in self.down_since.items() if s in watched}
        crashed = []
        for seen in watched:
            if not self.down(seen):
                self.down_since.pop(seen, None)
                version = self.served(seen.endpoint) if self.served is not None else None
                if version is None or version >= seen.weights_version:
                    continue
                reason = (f"the server of worker {seen.worker_id} at {seen.endpoint} serves weights version "
                          f"{version}, its row says {seen.weights_version}: restarted by other means")
            else:
                since = self.down_since.setdefault(seen, now)
                if now - since < self.crash_after_s:
                    continue
                reason = (f"the server of worker {seen.worker_id} at {seen.endpoint} (generation {seen.generation}) "
                          f"is gone: no process, no answer for {now - since:.0f} s")
            with transaction(self.engine, actor=f"agent {self.node}", reason=reason) as session:
                taken = crashes.mark_crashed(session, seen)
            self.down_since.pop(seen, None)
            if not taken:
                continue
            log.error("%s: worker %s out of service, its GPUs free", reason, seen.worker_id,
                      extra={"action": "server_crashed"})
            crashed.append(seen.worker_id)
            self._deregister(seen.endpoint)
        return crashed

    def register_missing(self) -> list[int]:
        """Register again the serving workers the front door does not list (module docstring); the workers."""
        door = self.front_door()
        started = door.started()
        now = self.clock()
        if started is None or (started == self.door_seen and now < self.next_relist):
            return []
        with transaction(self.engine) as session:
            watched = crashes.serving(session, self.node)
        listed = door.listed()
        if listed is None:  # stopped, or no clear answer: ask again next pass
            return []
        self.door_seen, self.next_relist = started, now + self.relist_s * random.uniform(0.8, 1.2)
        registered = []
        for seen in watched:
            server = self.driver.running(seen.worker_id)
            if server is None or server.endpoint != seen.endpoint or (server.endpoint, server.role) in listed:
                continue
            if not self.health(server.endpoint):
                continue
            with self.aside(seen.worker_id) as held:
                if not held:
                    continue
                with transaction(self.engine) as session:
                    if seen not in crashes.serving(session, self.node):
                        continue
                try:
                    door.register(server.endpoint, server.role.value, server.bootstrap_port)
                except DriverError as exc:  # the next pass tries again
                    log.warning("front door: could not register worker %d at %s again: %s", seen.worker_id,
                                server.endpoint, exc)
                    self.next_relist = now
                    continue
                with transaction(self.engine) as session:
                    still = crashes.still_active(session, seen)
                if not still:
                    self._deregister(seen.endpoint)
                    continue
            log.warning("the front door did not list worker %d at %s (restarted?): registered it again as %s",
                        seen.worker_id, server.endpoint, server.role.value, extra={"action": "register_again"})
            registered.append(seen.worker_id)
        return registered

    def _deregister(self, endpoint: str) -> None:
        try:
            self.front_door().deregister(endpoint)
        except Exception as exc:  # the front door drops a dead server by itself too
            log.warning("front door: could not deregister %s: %s", endpoint, exc)
