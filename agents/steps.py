"""What an agent does for each plan step: the server calls (through the driver and SGLang's HTTP API)
and the fenced row changes around them (`controlplane.store.step_effects`).

Every handler is idempotent: it looks at the rows and at the server first and does only what is
missing, so a step run twice (a rescued claim, a handed-back step) takes effect once. Every command
to a server carries the claim's fencing token. A handler calls `ctx.check()` (or waits through
`ctx.wait`) so that a step whose plan stopped, or whose claim was lost, stops promptly; it ends with
`ctx.complete(...)`, which writes the end of the effect and the success in one transaction.

  drain         out of service in the rows, off the front door (new requests go elsewhere)
  interrupt     abort what still runs (`pause_generation` abort): the front door resubmits each
                request's rest, with what it generated kept, to another worker; a server that does
                not answer, or still runs requests `Timeouts.idle_s` after the abort, is stopped
  release       overlap: release the GPU memory (the server sleeps until the next loan; one that
                cannot is stopped); dedicated: stop the server; then its GPUs are free in the rows
  start         take the GPUs in the rows first, then resume a sleeping server (a prefill <-> decode
                change flips it) or launch one, and wait until it answers
  load_weights  bring the server to the trainer's latest weights (a snapshot from disk), under the
                worker's sync lock (never beside a weight sync of the same server, never back to an
                older version); a version published meanwhile is loaded in turn
  admit         once the worker has the trainer's current weights (a sync may bring a version that came
                out after its load_weights; `Timeouts.weights_s`), register with the front door, then
                active in the rows
  flip_role     wait until idle, then `pd_role_switch` in place (to decode: with the decode CUDA graph
                memory a decode peer reports); a server that refuses the switch is restarted in the
                new role
  router_sync   switch the front door to the target mode
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pearl.agents.drivers.base import Driver, DriverError, Server, ServerSpec, WeightsRef
from pearl.controlplane.core.domain import Role, StepAction, WorkerZone
from pearl.controlplane.errors import PearlError
from pearl.controlplane.store import plan_store, step_effects
from pearl.controlplane.store import weights as weight_rows
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.step_view import WorkerView, decode_peer_endpoints, worker_view

log = logging.getLogger("pearl.agent")


class StepCancelled(PearlError):
    """The step stops: its plan stopped applying, its claim was lost, or its agent is shutting down."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason  # "plan", "claim" or "shutdown"


class ServerAPI(Protocol):
    """The part of SGLang's HTTP API the steps use (`agents.server_client.ServerClient`); a client is
    made for one step and carries its fencing token on every command."""

    def health(self) -> bool: ...
    def is_idle(self) -> bool: ...
    def model_info(self) -> dict[str, Any]: ...
    def pause_generation(self, mode: str = "abort") -> Any: ...
    def continue_generation(self) -> Any: ...
    def release_memory_occupation(self) -> Any: ...
    def resume_memory_occupation(self) -> Any: ...
    def pd_role_switch(self, new_role: str, decode_cuda_graph_memory_gb: float | None = None) -> Any: ...
    def graph_memory_gb(self) -> float: ...
    def update_weights_from_disk(self, model_path: str, weight_version: int) -> Any: ...


class FrontDoorAPI(Protocol):
    """What the steps and the server watch ask of the front door (`agents.router_client.FleetFrontDoor`):
    which workers it routes to, and its mode."""

    def register(self, url: str, role: str, bootstrap_port: int | None = None) -> Any: ...
    def deregister(self, url: str) -> Any: ...
    def set_mode(self, mode: str) -> None: ...
    def started(self) -> Any: ...
    def listed(self) -> set[tuple[str, Role]] | None: ...


class NoFrontDoor:
    """A fleet with no front door registered: clients reach the servers some other way."""

    def register(self, url: str, role: str, bootstrap_port: int | None = None) -> None:
        return None

    def deregister(self, url: str) -> None:
        return None

    def set_mode(self, mode: str) -> None:
        return None

    def started(self) -> None:
        return None

    def listed(self) -> None:
        return None


@dataclass(frozen=True)
class Timeouts:
    """How long a step waits on a server (seconds of wall time)."""

    ready_s: float = 600.0  # a launched server answers /health
    # How long a drained server may finish its requests before the next step (an interrupt aborts the
    # rest, kept by the front door; a flip waits for idle itself): shrinking is urgent, so none.
    drain_s: float = 0.0
    idle_s: float = 60.0  # an interrupted or drained server has nothing left running
    weights_s: float = 600.0  # an admitted worker reaches the trainer's current weights version
    front_door_s: float = 30.0  # a front door that gives no answer (restarting) is tried again this long
    poll_s: float = 0.05


@dataclass
class StepContext:
    """One claimed step as its handler sees it."""

    engine: Any
    step: Mapping[str, Any]  # the claimed row (id, key, action, args, fence, worker_id, ...)
    driver: Driver
    client: Callable[[str, int], ServerAPI]  # (endpoint, fence) -> API client
    front_door: Callable[[], FrontDoorAPI]
    node_address: str
    actor: str
    timeouts: Timeouts = field(default_factory=Timeouts)
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = "plan"
    finishing: bool = False  # the handler is past its server calls (reporting, or ended)

    @property
    def id(self) -> int:
        return int(self.step["id"])

    @property
    def fence(self) -> int:
        return int(self.step["fence"])

    @property
    def action(self) -> StepAction:
        return StepAction(self.step["action"])

    @property
    def args(self) -> Mapping[str, Any]:
        return self.step.get("args") or {}

    def stop(self, reason: str) -> None:
        """Ask the handler to stop; the first reason stands (a plan that stopped applying, or a lost
        claim, is not turned into a hand-back by the shutdown that follows)."""
        if not self.cancel.is_set():
            self.cancel_reason = reason
        self.cancel.set()

    def check(self) -> None:
        if self.cancel.is_set():
            raise StepCancelled(self.cancel_reason, f"step {self.step['key']} stops: {self.cancel_reason}")

    def wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> bool:
        """Poll `done` until true (True) or `timeout_s` passes (False); stops early if cancelled."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            if done():
                return True
            if time.monotonic() >= deadline:
                log.info("%s: %s not reached after %.1f s", self.step["key"], what, timeout_s)
                return False
            self.cancel.wait(self.timeouts.poll_s)

    def worker(self) -> WorkerView:
        with transaction(self.engine) as session:
            return worker_view(session, int(self.step["worker_id"]))

    def begin(self) -> WorkerView:
        """The part of the effect before the server is touched (fenced), then the worker as it is."""
        self.check()
        with transaction(self.engine, actor=self.actor, reason=f"step {self.step['key']}") as session:
            step_effects.begin(session, step_effects.claimed_step(session, self.id, self.fence))
            return worker_view(session, int(self.step["worker_id"]))

    def complete(self, **effect: Any) -> plan_store.PlanProgress:
        """The end of the effect and the success, in one fenced transaction."""
        self.check()
        self.finishing = True  # set before the commit: the worker's next step may be claimed at once
        with transaction(self.engine, actor=self.actor, reason=f"step {self.step['key']}") as session:
            return plan_store.complete_step(session, self.id, self.fence, **effect)

    def server_api(self, server: Server) -> ServerAPI:
        return _Guarded(self.client(server.endpoint, self.fence), self.guard)  # type: ignore[return-value]

    def guard(self) -> None:
        """Before each command to a server: the step is not cancelled and its claim still holds in the
        rows. The simulated server refuses an older `X-Pearl-Fence`; stock SGLang ignores the header,
        so this read is what keeps an agent whose claim was taken over from commanding the server."""
        self.check()
        with transaction(self.engine) as session:
            stopped = step_effects.claim_state(session, self.id, self.fence)
        if stopped is not None:
            self.stop(stopped)
            self.check()


class _Guarded:
    """A server client whose commands (not its reads) first pass the step's guard."""

    COMMANDS = frozenset({"pause_generation", "continue_generation", "release_memory_occupation",
                          "resume_memory_occupation", "pd_role_switch", "update_weights_from_disk", "flush_cache"})

    def __init__(self, api: Any, guard: Callable[[], None]) -> None:
        self._api = api
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._api, name)
        if name not in self.COMMANDS:
            return attr

        def guarded(*args: Any, **kwargs: Any) -> Any:
            self._guard()
            return attr(*args, **kwargs)
        return guarded


def _idle(api: ServerAPI) -> Callable[[], bool]:
    def idle() -> bool:
        try:
            return api.is_idle()
        except DriverError:
            return False
    return idle


def drain(ctx: StepContext) -> None:
    w = ctx.begin()
    server = ctx.driver.running(w.id)
    endpoint = server.endpoint if server is not None else w.endpoint
    if endpoint:
        _at_front_door(ctx, lambda: ctx.front_door().deregister(endpoint), f"deregistering worker {w.id}")
    if server is not None and ctx.timeouts.drain_s > 0:
        ctx.wait(_idle(ctx.server_api(server)), ctx.timeouts.drain_s, "idle after drain")
    ctx.complete()


def interrupt(ctx: StepContext) -> None:
    w = ctx.worker()
    server = ctx.driver.running(w.id)
    if server is not None and not _interrupted(ctx, ctx.server_api(server)):
        # a hung server (no answer, or requests still running after the abort): stopping it ends them
        # (the front door resubmits each), and its GPUs can still be given back
        ctx.check()  # a step that stopped (its plan, its claim) stops nothing
        log.warning("%s: the server of worker %d did not stop its requests; stopping it", ctx.step["key"], w.id,
                    extra={"action": "stop_hung_server"})
        ctx.driver.stop(w.id, pid=server.pid)
    ctx.complete()


def _fenced_out(exc: DriverError) -> bool:
    """The server refused the command's fencing token: a newer claim commands it now."""
    return exc.status == 409


def _interrupted(ctx: StepContext, api: ServerAPI) -> bool:
    """Abort what the server runs. False when it gives no answer for `Timeouts.idle_s`, or still runs
    requests that long after the abort; a newer claim's fence refusing this one raises."""
    seen: dict[str, Any] = {}

    def answered() -> bool:
        try:
            seen["idle"] = api.is_idle()
            return True
        except DriverError as exc:
            seen["error"] = exc
            ctx.cancel.wait(0.5)
            return False

    if not ctx.wait(answered, ctx.timeouts.idle_s, "an answer"):
        log.warning("%s: %s", ctx.step["key"], seen.get("error"))
        return False
    if seen["idle"]:
        return True
    try:
        api.pause_generation("abort")
    except DriverError as exc:
        if _fenced_out(exc):
            raise
        log.warning("%s: %s", ctx.step["key"], exc)
        return False
    if not ctx.wait(_idle(api), ctx.timeouts.idle_s, "idle after interrupt"):
        return False
    try:
        api.continue_generation()
    except DriverError as exc:  # idle already; the release that follows does not need it serving
        log.warning("%s: continue_generation after the abort: %s", ctx.step["key"], exc)
    return True


def _released(ctx: StepContext, api: ServerAPI) -> bool:
    """Release the server's GPU memory, trying again until `Timeouts.idle_s` has passed."""
    errors: list[DriverError] = []

    def done() -> bool:
        try:
            api.release_memory_occupation()
            return True
        except DriverError as exc:
            if _fenced_out(exc):
                raise
            errors.append(exc)
            ctx.cancel.wait(1.0)
            return False

    if ctx.wait(done, ctx.timeouts.idle_s, "memory released"):
        return True
    log.warning("%s: %s", ctx.step["key"], errors[-1] if errors else "no answer")
    return False


def release(ctx: StepContext) -> None:
    w = ctx.begin()
    server = ctx.driver.running(w.id)
    if server is not None:
        if w.zone is not WorkerZone.OVERLAP:
            ctx.driver.stop(w.id)
        elif not _released(ctx, ctx.server_api(server)):  # asleep until the next loan, or else stopped:
            ctx.check()  # the memory must be given back
            log.warning("%s: the server of worker %d cannot release its memory; stopping it", ctx.step["key"],
                        w.id, extra={"action": "stop_hung_server"})
            ctx.driver.stop(w.id, pid=server.pid)
    ctx.complete()


def start(ctx: StepContext) -> None:
    w = ctx.begin()
    role = Role(ctx.args["role"])
    server = ctx.driver.running(w.id)
    launched = False
    if server is not None and w.zone is WorkerZone.OVERLAP and (server.role is Role.COLOCATED) == (
            role is Role.COLOCATED):
        ctx.server_api(server).resume_memory_occupation()  # the server slept through the training step: wake it
        if server.role is not role:
            server, launched = _switch_role(ctx, w, server, role)
    elif server is None or server.generation != w.generation or server.role is not role:
        server = _relaunch(ctx, w, server, role)
        launched = True
    ctx.check()
    ctx.driver.wait_ready(server, ctx.timeouts.ready_s)
    ctx.complete(endpoint=server.endpoint, cold=launched)


def _relaunch(ctx: StepContext, w: WorkerView, server: Server | None, role: Role) -> Server:
    if server is not None:
        ctx.driver.stop(w.id)
    return ctx.driver.launch(ServerSpec(
        worker_id=w.id, node=w.node, host=ctx.node_address, role=role, devices=w.devices, tp=w.tp,
        model=w.model, gpu=w.gpu, generation=w.generation, fence=ctx.fence,
        overlap=w.zone is WorkerZone.OVERLAP, weights=_weights(w),
    ))


def _switch_role(ctx: StepContext, w: WorkerView, server: Server, role: Role) -> tuple[Server, bool]:
    """prefill <-> decode in place; a server that refuses (SGLang answers 400: no room for its decode
    graphs, a backend without role switch, unhealthy after a failed switch) is restarted in the new
    role. (server, whether it was launched)."""
    graph_gb = _decode_graph_gb(ctx, w) if role is Role.DECODE else None
    try:
        ctx.server_api(server).pd_role_switch(role.value, decode_cuda_graph_memory_gb=graph_gb)
    except DriverError as exc:
        if exc.status != 400:
            raise
        ctx.check()
        log.warning("%s: worker %d refused the switch to %s (%s); restarting it as %s", ctx.step["key"], w.id,
                    role.value, exc, role.value, extra={"action": "role_switch_restart"})
        return _relaunch(ctx, w, server, role), True
    ctx.driver.record_role(w.id, role)
    return server, False


def _decode_graph_gb(ctx: StepContext, w: WorkerView) -> float | None:
    """The decode CUDA graph memory of a serving decode peer (what SGLang needs told before it captures
    the graphs on a flip to decode); None when no peer answers."""
    with transaction(ctx.engine) as session:
        peers = decode_peer_endpoints(session, w.id)
    for endpoint in peers:
        try:
            graph_gb = ctx.client(endpoint, ctx.fence).graph_memory_gb()
        except DriverError:
            continue
        if graph_gb > 0:
            return graph_gb
    return None


def _weights(w: WorkerView) -> WeightsRef | None:
    return WeightsRef(w.trainer_version, w.snapshot) if w.trainer_version and w.snapshot else None


LOAD_ROUNDS = 3  # a trainer publishing again while a load runs: the newer version is loaded, this often


def load_weights(ctx: StepContext) -> None:
    """Bring the starting worker to the trainer's version. Under the worker's sync lock, so a weight
    sync of the same server (queued for it when the trainer published) never runs beside it; a server
    already at that version or newer is not loaded again (never back to an older one); and a version
    published while the load ran is loaded in turn, instead of failing the step and its plan."""
    for round_ in range(LOAD_ROUNDS):
        w = ctx.worker()
        version = w.trainer_version
        if version > w.weights_version:
            _load(ctx, w, version)
        try:
            ctx.complete(weights_version=max(version, w.weights_version))
            return
        except step_effects.EffectMissing:
            if round_ == LOAD_ROUNDS - 1:
                raise
            log.info("%s: the trainer published a newer version during the load; loading it",
                     ctx.step["key"])


def _load(ctx: StepContext, w: WorkerView, version: int) -> None:
    server = ctx.driver.running(w.id)
    if server is None:
        raise DriverError(f"worker {w.id} has no server to load weights version {version} into")
    if not w.snapshot:
        raise DriverError(f"weights version {version} has no snapshot to load")
    with weight_rows.sync_lock(ctx.engine, w.id, ctx.timeouts.weights_s, cancelled=ctx.cancel) as held:
        ctx.check()  # stopped while it waited: the step ends now, not when the wait runs out
        if not held:
            raise DriverError(f"worker {w.id}: a weight sync held it for {ctx.timeouts.weights_s:g} s")
        ctx.check()
        api = ctx.server_api(server)
        if served_version(api.model_info()) < version:
            api.update_weights_from_disk(w.snapshot, version)
        loaded = served_version(api.model_info())
    if loaded < version:
        raise DriverError(f"worker {w.id} reports weights version {loaded} after loading {version}")


def served_version(model_info: Mapping[str, Any]) -> int:
    """The weights version a server reports (SGLang's `weight_version`: "default" for the weights it
    started with, which are version 0 here)."""
    raw = model_info.get("weight_version")
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


def admit(ctx: StepContext) -> None:
    w = ctx.worker()
    server = ctx.driver.running(w.id)
    if server is None:
        raise DriverError(f"worker {w.id} has no server to admit")
    if not ctx.wait(lambda: _has_current_weights(ctx), ctx.timeouts.weights_s, "the current weights"):
        w = ctx.worker()
        raise DriverError(f"worker {w.id} has weights version {w.weights_version}, the trainer is at "
                          f"{w.trainer_version}: version {w.trainer_version} did not arrive within "
                          f"{ctx.timeouts.weights_s:g} s; not admitted{_sync_note(ctx, w.id)}")
    role = Role(ctx.args["role"]).value
    _at_front_door(ctx, lambda: ctx.front_door().register(server.endpoint, role, server.bootstrap_port),
                   f"registering worker {w.id}")
    ctx.complete()


def _at_front_door(ctx: StepContext, call: Callable[[], object], what: str) -> None:
    """`call` to the front door, tried again while it gives no answer (it is restarting: the next try
    finds its new address in the rows) for up to `Timeouts.front_door_s`; a refusal raises at once."""
    failed: list[DriverError] = []

    def attempt() -> bool:
        try:
            call()
            return True
        except DriverError as exc:
            if exc.status is not None:
                raise
            failed[:] = [exc]
            return False

    if not ctx.wait(attempt, ctx.timeouts.front_door_s, what):
        raise failed[-1] if failed else DriverError(f"{what}: the front door did not answer")


def _has_current_weights(ctx: StepContext) -> bool:
    """The worker has the trainer's version; DriverError at once when its sync to it failed."""
    w = ctx.worker()
    if w.weights_version >= w.trainer_version:
        return True
    with transaction(ctx.engine) as session:
        sync = weight_rows.last_sync_states(session).get(w.id)
    if sync and sync["version"] == w.trainer_version and sync["state"] == "failed":
        raise DriverError(f"worker {w.id}: its sync to weights version {w.trainer_version} failed "
                          f"({sync['error']}); not admitted")
    return False


def _sync_note(ctx: StepContext, worker_id: int) -> str:
    with transaction(ctx.engine) as session:
        sync = weight_rows.last_sync_states(session).get(worker_id)
    if not sync:
        return " (no sync of it was queued)"
    return f" (its sync to version {sync['version']} is {sync['state']}" + (
        f": {sync['error']})" if sync["error"] else "; is the node's `pearlctl worker` running?)")


def flip_role(ctx: StepContext) -> None:
    w = ctx.worker()
    role = Role(ctx.args["role"])
    server = ctx.driver.running(w.id)
    if server is None:
        raise DriverError(f"worker {w.id} has no server to flip to {role}")
    if server.role is not role:
        api = ctx.server_api(server)
        if not ctx.wait(_idle(api), ctx.timeouts.idle_s, "idle before the role switch"):
            raise DriverError(f"worker {w.id} is not idle after {ctx.timeouts.idle_s:g} s; a role switch needs it idle")
        server, launched = _switch_role(ctx, w, server, role)
        if launched:
            ctx.check()
            ctx.driver.wait_ready(server, ctx.timeouts.ready_s)
    ctx.complete(endpoint=server.endpoint)


def router_sync(ctx: StepContext) -> None:
    ctx.check()
    ctx.front_door().set_mode(str(ctx.args["mode"]))
    ctx.complete()


HANDLERS: dict[StepAction, Callable[[StepContext], None]] = {
    StepAction.DRAIN: drain,
    StepAction.INTERRUPT: interrupt,
    StepAction.RELEASE: release,
    StepAction.START: start,
    StepAction.LOAD_WEIGHTS: load_weights,
    StepAction.ADMIT: admit,
    StepAction.FLIP_ROLE: flip_role,
    StepAction.ROUTER_SYNC: router_sync,
}
