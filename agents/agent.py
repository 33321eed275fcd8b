"""The node agent (`pearlctl agent --node NAME`): claims its node's plan steps and enacts them.

Stateless: everything it needs is in the rows and in its driver's run directory, so it can be killed
at any instant and a new one carries on. The loop:
- registers an `agents` row (refused while another agent of the node is alive: `NodeTaken`),
  heartbeats it every `heartbeat_s` (the database's clock), and renews the lease of every step in
  hand; a renewal that finds the claim lost, or the plan no longer applying, stops that step; a
  heartbeat that finds a newer agent of the node (this one was silent long enough to be replaced)
  stops the agent, and `run` raises `NodeTaken` once it has;
- wakes on NOTIFY (its node's channel `pearl_steps_<node id>`, and `pearl_plans`), and polls every
  `poll_s` anyway: the rows are the truth, a notification only a hint;
- claims up to `max_steps` ready steps of its node in one statement (`claim_steps`, SKIP LOCKED, at
  most one per worker, none of a worker it is still at work on) and enacts each in a thread of its own
  (`agents.steps`);
- runs a reaper pass every `reap_every_s` while it holds the `reaper` leader lease;
- watches the servers of its node's active workers every `watch_s` (`agents.server_watch`): one whose
  process is gone and that does not answer for `crash_after_s` is taken out of service, its GPUs
  freed, and off the front door; one the front door does not list (restarted without its state) is
  registered again, with no step of that worker enacted meanwhile;
- reports each step with the fenced effect transaction: succeeded only with its effect in the rows;
  failed with the driver's message; cancelled once its plan stopped.
SIGTERM: it claims nothing more, lets the steps in hand finish for up to `grace_s`, hands back what is
left (another claim redoes what is missing), marks itself stopped and exits 0. SIGKILL loses nothing:
the leases of its steps expire and the reaper gives them to the next claim; the servers it launched
keep serving and the next agent on the node adopts them (the driver's run directory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pearl.agents.drivers.base import Driver
from pearl.agents.server_watch import ServerWatch
from pearl.agents.steps import HANDLERS, FrontDoorAPI, ServerAPI, StepCancelled, StepContext, Timeouts, served_version
from pearl.controlplane.core.domain import PlanStatus, StepStatus
from pearl.controlplane.errors import ClaimLost, DatabaseUnavailable, NodeTaken, PearlError
from pearl.controlplane.services import metrics
from pearl.controlplane.store import agent_registry, plan_store, reaper, step_effects
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.notifications import listen, step_channel
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.transitions import lock_node

log = logging.getLogger("pearl.agent")
THREAD_JOIN_S = 15.0  # at shutdown, how long the listener and a watch pass in progress may take to end
DB_RETRY_FIRST_S = 0.2  # a step whose database call failed runs again after this, doubling ...
DB_RETRY_MAX_S = 5.0  # ... up to this (its claim bounds the whole)


@dataclass(frozen=True)
class AgentConfig:
    node: str
    driver: str = "sim"
    lease_s: float = 20.0  # a claim's lease; renewed every heartbeat
    poll_s: float = 1.0  # claim at least this often, notifications or not
    heartbeat_s: float = 2.0
    max_steps: int = 8  # steps enacted at once (on distinct workers)
    reap_every_s: float = 5.0
    agent_timeout_s: float = agent_registry.DEFAULT_AGENT_TIMEOUT_S  # silent this long: gone (the reaper)
    max_attempts: int = 3  # claims of one step that may expire before it fails
    grace_s: float = 20.0  # SIGTERM: how long the steps in hand may take before they are handed back
    watch_s: float = 2.0  # how often the servers of active workers are looked at
    crash_after_s: float = 10.0  # a server gone (no process, no answer) this long has crashed
    relist_s: float = 30.0  # how often the front door is asked what it lists (and at each new start of it)
    timeouts: Timeouts = field(default_factory=Timeouts)


class Agent:
    def __init__(self, engine: Any, config: AgentConfig, driver: Driver, *,
                 client: Callable[[str, int | None], ServerAPI], front_door: Callable[[], FrontDoorAPI],
                 reaper_engine: Any = ...) -> None:
        self.engine = engine
        # the reaper's passes change every node's rows: under per-component roles they run on an engine
        # of the policy role (controlplane/store/roles.py); None: this agent does not reap
        self.reaper_engine = engine if reaper_engine is ... else reaper_engine
        self.config = config
        self.driver = driver
        self.client = client
        self.front_door = front_door
        self.registration: agent_registry.Registration | None = None
        self.superseded: NodeTaken | None = None  # a newer agent took the node over: this one stopped
        self.holder = agent_registry.holder_name(socket.gethostname(), os.getpid(), config.node)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._plan_changed = threading.Event()
        self._lock = threading.Lock()
        self._in_hand: dict[int, StepContext] = {}  # step id -> its context
        self._aside: dict[int, int] = {}  # workers held aside (how many holds): no step of theirs meanwhile
        self._pool = ThreadPoolExecutor(max_workers=config.max_steps, thread_name_prefix=f"step-{config.node}")
        self._threads: list[threading.Thread] = []  # listener, watcher, relister: joined at shutdown

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to stop (SIGTERM): finish or hand back the steps in hand, then exit."""
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Register, then loop until `stop()`."""
        c = self.config
        self.registration = agent_registry.register_agent(self.engine, c.node, host=socket.gethostname(),
                                                          pid=os.getpid(), driver=c.driver,
                                                          agent_timeout_s=c.agent_timeout_s)
        log.info("agent %s started on node %s (driver %s)", self.registration.agent_id, c.node, c.driver,
                 extra={"action": "start_agent"})
        self._start_thread(self._listen, f"listen-{c.node}")
        self._start_thread(self._watch, f"watch-{c.node}")
        next_beat = next_reap = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                try:
                    if now >= next_beat or self._plan_changed.is_set():
                        self._plan_changed.clear()
                        self._heartbeat()
                        next_beat = now + c.heartbeat_s
                    if now >= next_reap:
                        self._reap()
                        next_reap = now + c.reap_every_s
                    self._claim()
                except NodeTaken as exc:  # a newer agent runs the node: leave it to that one
                    log.error("%s; stopping", exc, extra={"action": "superseded"})
                    self.superseded = exc
                    self.stop()
                except DatabaseUnavailable as exc:  # keep trying: the steps in hand keep their leases for a while
                    log.warning("database unavailable: %s", exc, extra={"action": "database_unavailable"})
                except Exception as exc:  # a deadlock, a refused change: the rows are the truth, look again
                    log.exception("agent loop: %s", exc, extra={"action": "loop_error"})
                    self._stop.wait(1.0)
                self._wake.wait(min(c.poll_s, max(0.0, next_beat - time.monotonic())))
                self._wake.clear()
        finally:
            self._shutdown()
        if self.superseded is not None:
            raise self.superseded

    def _shutdown(self) -> None:
        c = self.config
        deadline = time.monotonic() + c.grace_s
        while self._in_hand and time.monotonic() < deadline and self.superseded is None:
            try:
                self._heartbeat()
            except NodeTaken as exc:  # the newer agent redoes what the steps in hand leave undone
                self.superseded = exc
            except PearlError as exc:  # the database away: the grace still runs out
                log.warning("heartbeat: %s", exc)
            time.sleep(min(0.1, c.heartbeat_s))
        with self._lock:
            left = list(self._in_hand.values())
        for ctx in left:
            ctx.stop("shutdown")
        self._pool.shutdown(wait=True)
        self._stop.set()  # also when the loop ended by an exception
        self._join_threads(deadline=time.monotonic() + THREAD_JOIN_S)
        if self.registration is not None:
            try:
                agent_registry.mark_stopped(self.engine, self.registration.agent_id)
            except PearlError as exc:
                log.warning("could not mark the agent stopped: %s", exc)
        log.info("agent stopped", extra={"action": "stop_agent"})

    def _start_thread(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _join_threads(self, deadline: float) -> None:
        """Wait for the listener and the watch passes to end: `run` returns with no thread of its own
        still using the engine (a caller that disposes it then leaves no connection behind)."""
        while True:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive:
                return
            if time.monotonic() >= deadline:
                log.warning("still running at shutdown: %s", ", ".join(t.name for t in alive))
                return
            alive[0].join(timeout=max(0.0, deadline - time.monotonic()))

    # -- the loop's parts -----------------------------------------------------------------------

    def _heartbeat(self) -> None:
        assert self.registration is not None
        agent_registry.heartbeat(self.engine, self.registration.agent_id, self.config.agent_timeout_s)
        with self._lock:
            in_hand = list(self._in_hand.values())
        for ctx in in_hand:
            with transaction(self.engine) as session:
                row = session.execute(query("renew_step_lease"), {"step_id": ctx.id, "fence": ctx.fence,
                                                                  "lease_s": self.config.lease_s}).first()
            if row is None:
                ctx.stop("claim")
            elif row.plan_status != PlanStatus.APPLYING.value:
                ctx.stop("plan")

    def _reap(self) -> None:
        c = self.config
        if self.reaper_engine is None:
            return
        if agent_registry.hold_leader_lease(self.reaper_engine, "reaper", self.holder, ttl_s=3 * c.reap_every_s):
            report = reaper.reap(self.reaper_engine, max_attempts=c.max_attempts, agent_timeout_s=c.agent_timeout_s,
                                 actor=f"reaper in agent {c.node}")
            if not report.empty:
                metrics.RESCUES.inc(len(report.rescued))
                metrics.REAPED_PLANS.inc(len(report.failed_plans))
                log.info("reaped %s", report.to_dict(), extra={"action": "reap"})

    def _claim(self) -> None:
        assert self.registration is not None
        with self._lock:
            free = self.config.max_steps - len(self._in_hand)
            busy = self._busy()
        if free <= 0 or self._stop.is_set():
            return
        with transaction(self.engine, actor=f"agent {self.config.node}") as session:
            rows = plan_store.claim_steps(session, self.registration.node_id, self.registration.agent_id,
                                          lease_s=self.config.lease_s, limit=free, busy=busy)
        for row in rows:
            ctx = StepContext(self.engine, row, self.driver, self.client, self.front_door,
                              self.registration.address, actor=f"agent {self.config.node}",
                              timeouts=self.config.timeouts)
            with self._lock:  # "is the worker busy" and "now it is" in one critical section (see `_held_aside`)
                late = row["worker_id"] in self._busy()
                if not late:
                    self._in_hand[ctx.id] = ctx
            if late:  # the watch held the worker aside since the claim's `busy` was read: not beside it
                log.info("%s: worker %s is busy; handing the step back", row["key"], row["worker_id"],
                         extra={"action": "claim_deferred"})
                self._hand_back(row)
                continue
            log.info("claimed %s (step %s, fence %s)", row["key"], row["id"], row["fence"],
                     extra={"action": "claim_step"})
            metrics.STEP_CLAIMS.inc()
            self._pool.submit(self._enact, ctx, time.monotonic())
        self._count_in_hand()

    def _busy(self) -> set[int]:
        """The workers this agent is at work on (call with `_lock` held): held aside for the server watch,
        or with a step in hand whose thread has not finished (one whose claim lapsed may still be in its
        server call). Their steps are left for later, without holding back the other workers'."""
        return set(self._aside) | {c.step["worker_id"] for c in self._in_hand.values() if not c.finishing}

    def _enact(self, ctx: StepContext, claimed: float) -> None:
        key = ctx.step["key"]
        outcome = "succeeded"
        try:
            try:
                self._run_handler(ctx)
            finally:
                ctx.finishing = True
            log.info("%s succeeded", key, extra={"action": "step_success"})
        except StepCancelled as exc:
            outcome = self._stopped(ctx, exc.reason)
        except step_effects.PlanStopped:
            outcome = self._stopped(ctx, "plan")
        except ClaimLost as exc:
            outcome = "claim_lost"
            log.warning("%s: %s", key, exc, extra={"action": "claim_lost"})
        except Exception as exc:  # the step failed: report it, with the driver's message
            outcome = "failed"
            log.warning("%s failed: %s", key, exc, extra={"action": "step_failure"})
            self._report(ctx, StepStatus.FAILED, f"{type(exc).__name__}: {exc}" if not isinstance(exc, PearlError)
                         else str(exc))
        finally:
            with self._lock:  # only this claim's context: the step may have been claimed again since
                if self._in_hand.get(ctx.id) is ctx:
                    del self._in_hand[ctx.id]
            action = str(ctx.action)
            metrics.STEPS.labels(action, outcome).inc()
            metrics.STEP_SECONDS.labels(action, outcome).observe(time.monotonic() - claimed)
            self._count_in_hand()
            self._wake.set()

    def _count_in_hand(self) -> None:
        with self._lock:
            metrics.STEPS_IN_HAND.set(len(self._in_hand))

    def _run_handler(self, ctx: StepContext) -> None:
        """The step's handler; run again while the database is away or gives up on a statement (a
        dropped connection, a cancelled statement, a deadlock): handlers are idempotent, and the step
        is not the database's fault. The claim decides how long: once it is lost (the lease ran out and
        the reaper handed the step on) or the step is stopped, the step ends."""
        wait_s = DB_RETRY_FIRST_S
        while True:
            try:
                HANDLERS[ctx.action](ctx)
                return
            except DatabaseUnavailable as exc:
                metrics.STEP_DB_RETRIES.inc()
                log.warning("%s: %s; the step runs again in %.1f s", ctx.step["key"], exc, wait_s,
                            extra={"action": "step_database_retry"})
            ctx.cancel.wait(wait_s)
            ctx.check()
            wait_s = min(wait_s * 2, DB_RETRY_MAX_S)

    def _stopped(self, ctx: StepContext, reason: str) -> str:
        """Report or hand back a stopped step; its outcome (cancelled, handed_back, claim_lost)."""
        if reason == "plan":
            self._report(ctx, StepStatus.CANCELLED, "its plan stopped applying")
            return "cancelled"
        if reason == "shutdown":
            self._hand_back(ctx.step)
            return "handed_back"
        return "claim_lost"

    def _hand_back(self, step: Any) -> None:
        """Give a claimed step back (not counted as an attempt): ready again, or cancelled if its plan
        stopped applying."""
        try:
            with transaction(self.engine, actor=f"agent {self.config.node}") as session:
                lock_node(session, step["node_id"])  # as a report: the node, then the step
                row = session.execute(query("hand_back_step"), {"step_id": step["id"], "fence": step["fence"]}).first()
            stopped = row is not None and row.status != StepStatus.READY.value
            log.info("%s handed back%s", step["key"], " (its plan stopped: cancelled)" if stopped else "",
                     extra={"action": "hand_back_step"})
        except Exception as exc:  # the lease runs out and the reaper takes the step back
            log.warning("%s: could not hand back: %s", step["key"], exc)

    def _report(self, ctx: StepContext, status: StepStatus, error: str) -> None:
        try:
            with transaction(self.engine, actor=f"agent {self.config.node}") as session:
                plan_store.finish_step(session, ctx.id, ctx.fence, status, error=error)
        except step_effects.PlanStopped:
            pass
        except ClaimLost as exc:
            log.warning("%s: %s", ctx.step["key"], exc, extra={"action": "claim_lost"})
        except Exception as exc:  # the lease runs out and the reaper takes the step back
            log.warning("%s: could not report %s: %s", ctx.step["key"], status, exc)

    # -- the servers between steps --------------------------------------------------------------

    def _served_version(self, endpoint: str) -> int | None:
        """The weights version the server at `endpoint` reports; None when it does not answer."""
        api = self.client(endpoint, None)
        try:
            return served_version(api.model_info())
        except Exception:  # no answer: the health check decides about that
            return None
        finally:
            close = getattr(api, "close", None)
            if close is not None:
                close()

    def _health(self, endpoint: str) -> bool:
        api = self.client(endpoint, None)
        try:
            return bool(api.health())
        except Exception:  # a client that raises for a server that does not answer: not healthy
            return False
        finally:
            close = getattr(api, "close", None)
            if close is not None:
                close()

    @contextlib.contextmanager
    def _held_aside(self, worker_id: int) -> Iterator[bool]:
        """Hold a worker aside for the server watch: True, and no step of it is claimed until the block
        ends (one claimed in the instant the hold began is handed back); False when a step of it is in
        hand now."""
        with self._lock:
            held = not any(c.step["worker_id"] == worker_id for c in self._in_hand.values())
            if held:
                self._aside[worker_id] = self._aside.get(worker_id, 0) + 1
        try:
            yield held
        finally:
            if held:
                with self._lock:
                    self._aside[worker_id] -= 1
                    if not self._aside[worker_id]:
                        del self._aside[worker_id]
                self._wake.set()  # a step of the worker may be waiting: claim it now

    def _watch(self) -> None:
        c = self.config
        watch = ServerWatch(self.engine, c.node, self.driver, self._health, self.front_door, c.crash_after_s,
                            aside=self._held_aside, relist_s=c.relist_s, served=self._served_version)
        self._start_thread(self._every, f"relist-{c.node}", watch.register_missing)
        self._every(watch.check, watch.stop_leftovers)

    def _every(self, *passes: Callable[[], list[int]]) -> None:
        """Run each pass every `watch_s` until the agent stops; one that fails does not stop the others."""
        while not self._stop.wait(self.config.watch_s):
            for one in passes:
                try:
                    if one():
                        self._wake.set()
                except Exception as exc:  # the database may be away a while: look again next time
                    log.warning("%s: %s", one.__name__, exc, extra={"action": "watch_failed"})

    # -- wake-ups -------------------------------------------------------------------------------

    def _listen(self) -> None:
        """NOTIFY wake-ups (a hint; the rows stay the truth)."""
        assert self.registration is not None

        def woken(channel: str, payload: str) -> None:
            if channel == "pearl_plans" and payload.endswith(":failed"):
                self._plan_changed.set()  # renew at once: a step of a stopped plan stops
            self._wake.set()  # a plan applied or a step of this node ready: claim at once, no heartbeat first

        # at start and after a reconnect, look at the rows at once: a wake-up may have been missed
        listen(self.engine, (step_channel(self.registration.node_id), "pearl_plans"), woken, self._stop,
               self._wake.set)
