"""The policy loop (`pearlctl loop`): a long-running leader that runs a policy pass (`tick`) whenever
the trainer, the rollout or the provider reports something, and at least every `interval_s`.

Leadership is the `policy` leader lease, renewed at every pass and wait; when the leader dies
(SIGKILL, a lost machine) another copy takes over once the lease runs out (`lease_s`). Wake-ups come
by NOTIFY (`pearl_signals`: training steps, rollout progress, telemetry, notices; `pearl_plans`: a
plan finished), coalesced so that a burst of reports makes one pass; polling on the interval stays
the truth. Rollout progress alone wakes a pass only when a new step began or the step's tail came
(the last decision's `recheck_remaining`), the points at which the simulator decides.
SIGTERM: the lease is given up at once (a follower takes over within its poll) and the loop exits 0.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from pearl.controlplane.errors import DatabaseUnavailable, PearlError
from pearl.controlplane.services import metrics
from pearl.controlplane.store import agent_registry, signals
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.notifications import listen
from pearl.policies.live.tick import LEADER, TickResult, default_holder, tick
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

log = logging.getLogger("pearl.loop")

_EVENTS = {"training_steps": "training", "rollout_progress": "rollout", "telemetry": "telemetry",
           "leases": "notice", "succeeded": "plan_done", "failed": "plan_failed"}


@dataclass(frozen=True)
class LoopConfig:
    interval_s: float = 10.0  # a pass at least this often
    lease_s: float = 15.0  # leadership lapses this long after the leader's last renewal
    manual: bool = False  # borrowing and PD changes wait for `pearlctl apply`
    min_gap_s: float = 0.2  # passes are at least this far apart (a burst of reports makes one)


class PolicyLoop:
    def __init__(self, engine: Engine, config: LoopConfig, holder: str | None = None) -> None:
        self.engine = engine
        self.config = config
        self.holder = holder or default_holder("loop")
        self.passes = 0
        self.leading = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._listening = threading.Event()
        self._lock = threading.Lock()
        self._events: list[str] = []
        self._step: int | None = None  # the rollout step the last pass saw
        self._recheck: int | None = None  # the last decision's tail threshold (Target.recheck_remaining)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        c = self.config
        listener = threading.Thread(target=self._listen, name="loop-listen", daemon=True)
        listener.start()
        # the first pass comes after LISTEN, so that nothing reported after it goes unheard
        self._listening.wait(5.0)
        log.info("policy loop %s started (interval %.1f s, lease %.1f s%s)", self.holder, c.interval_s, c.lease_s,
                 ", manual" if c.manual else "", extra={"action": "start_loop"})
        last_pass = -math.inf
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                if started - last_pass >= min(c.interval_s, c.lease_s / 3) or self._worth_a_pass():
                    last_pass = started
                    try:
                        self._pass()
                    except DatabaseUnavailable as exc:
                        metrics.PASSES.labels("failed").inc()
                        log.warning("database unavailable: %s", exc, extra={"action": "database_unavailable"})
                    except PearlError as exc:
                        metrics.PASSES.labels("failed").inc()
                        log.warning("pass failed: %s", exc, extra={"action": "tick_failed"})
                    except DBAPIError as exc:  # an error pearl has no name for ends the pass, not the loop
                        metrics.PASSES.labels("failed").inc()
                        log.error("pass failed on a database error: %s", exc, extra={"action": "tick_failed"})
                # the interval (and the lease's renewal, well within it) bounds the wait
                self._wake.wait(max(0.0, last_pass + min(c.interval_s, c.lease_s / 3) - time.monotonic()))
                self._wake.clear()
                gap = c.min_gap_s - (time.monotonic() - started)
                if gap > 0 and not self._stop.is_set():
                    self._stop.wait(gap)
        finally:
            self._stop.set()  # also when the loop ended by an exception
            listener.join(timeout=5.0)  # return with no thread of ours still connected
            try:
                agent_registry.release_leader_lease(self.engine, LEADER, self.holder)
            except PearlError as exc:
                log.warning("could not give the lease up: %s", exc)
            log.info("policy loop %s stopped", self.holder, extra={"action": "stop_loop"})

    def _worth_a_pass(self) -> bool:
        """Whether what woke the loop calls for a pass before the interval's: any report but rollout
        progress does; progress does when a new step began or its tail came (fewer trajectories left
        than the last decision asked to be woken at), as the simulator decides."""
        with self._lock:
            events = set(self._events)
        if not events:
            return False
        if events != {"rollout"}:
            return True
        try:
            with transaction(self.engine) as session:
                position = signals.rollout_position(session)
        except PearlError:
            return True
        if position is None:
            return True
        step, remaining = position
        if step != self._step or (self._recheck is not None and remaining <= self._recheck):
            return True
        with self._lock:
            self._events = [e for e in self._events if e != "rollout"]
        return False

    def _pass(self) -> TickResult | None:
        with self._lock:
            events, self._events = self._events, []
        with transaction(self.engine) as session:
            position = signals.rollout_position(session)
        self._step = position[0] if position is not None else None
        started = time.perf_counter()
        result = tick(self.engine, holder=self.holder, manual=self.config.manual, lease_s=self.config.lease_s,
                      event=",".join(dict.fromkeys(events)) or "interval", keep_lease=True)
        _count(result, time.perf_counter() - started)
        leading = result.leading
        if leading != self.leading:
            log.info("%s the policy loop", "leading" if leading else "following", extra={"action": "leadership"})
            self.leading = leading
        if leading:
            self.passes += 1
            self._recheck = result.recheck_remaining
        if result.ran or result.amended is not None:
            log.info("pass: %s", result.note, extra={"action": "tick", "plan": result.plan})
        return result

    def _listen(self) -> None:
        def woken(channel: str, payload: str) -> None:
            kind = payload.split(":")[-1] if channel == "pearl_plans" else payload
            with self._lock:
                self._events.append(_EVENTS.get(kind, kind))
            self._wake.set()

        def listening() -> None:
            if self._listening.is_set():  # a reconnect: what came meanwhile was not heard
                with self._lock:
                    self._events.append("reconnect")
                self._wake.set()
            self._listening.set()

        listen(self.engine, ("pearl_signals", "pearl_plans"), woken, self._stop, listening)


def _count(result: TickResult, seconds: float) -> None:
    """The pass in the loop's metrics: its outcome and, as the leader, its duration and decision."""
    metrics.LEADING.set(1 if result.leading else 0)
    if not result.leading:
        metrics.PASSES.labels("following").inc()
        return
    metrics.PASS_SECONDS.observe(seconds)
    decision = result.decision if result.ran else None
    if decision is None:
        metrics.PASSES.labels("unchanged").inc()
        return
    metrics.PASSES.labels("decided").inc()
    metrics.DECISIONS.labels((decision.get("target") or {}).get("mode") or "none").inc()
    for key, name in (("predicted_current_s", "current"), ("predicted_target_s", "target")):
        if decision.get(key) is not None:
            metrics.PREDICTED.labels(name).set(float(decision[key]))
