"""The front door: one stable client address over two real `sglang-router` processes.

A PD-mode router never routes to a colocated worker, so the front door keeps one child router per
mode, `colocated` (regular workers) and `split` (`--pd-disaggregation`: prefill and decode workers),
and sends each new request to the child of the current mode. A request already sent stays with its
child, so switching the mode fails nothing in flight (the agents drain the old child's workers before
they stop them).

What it adds to the routers:

- Partial trajectories are kept: a request answered `finish_reason: abort` (its worker was
  interrupted: pause_generation, a drain, SIGTERM) is sent again with the tokens generated so far
  appended to its input and its token budget reduced by as many, until the turn is complete; a
  request whose worker died (connection error or 5xx from the router) is sent again the same way.
  The client gets one answer, whose `meta_info.pearl` says how many times it was resubmitted and
  how many tokens were kept from interrupted attempts.
- While the current child has no worker that can serve (a mode switch under way, every worker
  restarting), requests are held, up to `max_held` of them for up to `hold_s` each, not failed.

Admin API for the agents (no database), on a port of its own (`admin_port`, bound to `admin_host`,
localhost by default) and, with a `token`, only for requests bearing it (`Authorization: Bearer`,
else 401): `POST /pearl/workers {url, role, bootstrap_port}` registers a
worker with the child of its role and returns once the child lists it (a child being restarted
records it, and lists it once it is back: `pending`); `DELETE /pearl/workers
{url}` returns once it is gone; `PUT /pearl/mode {mode}`; `PUT /pearl/workers {mode, workers}` makes
both children list exactly these workers; `GET /pearl/state` (also on the clients' port, read-only).
The clients' port serves `/generate`, `/health` and `/pearl/state`. The registrations and the mode are
also kept in `state.json` under the run directory, and a restarted front door registers again those
workers that answer `/health`. One restarted without it lists none: the node agents register their
serving workers again (agents/server_watch.py).

Processes: the children are started with the parent-death signal set (Linux), so they never outlive
the front door, even after a SIGKILL; SIGTERM stops them by PID (SIGTERM, then SIGKILL) and exits. A
child that exits on its own (killed, crashed) is started again on new ports and given back its
workers; requests for it are held meanwhile, and those it dropped are resubmitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.routing import REBALANCE_MIN_EXTRA, REBALANCE_RATIO, WORKER_TYPE

from .drivers.process import free_port

MODES = ("colocated", "split")
RETRYABLE = (500, 502, 503, 504)
ADMIN_TIMEOUT = aiohttp.ClientTimeout(total=10)  # a child router's admin calls
STABLE_S = 60.0  # a child router that ran this long before it died is started again at once
PROBE_EVERY_S = 2.0  # a running child router is asked `/workers` this often ...
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2)  # ... with this long to answer; ...
HUNG_PROBES = 3  # ... and one that misses this many in a row is hung (stopped, deadlocked): killed, started again
PR_SET_PDEATHSIG = 1


def child_mode(role: Role) -> str:
    return "colocated" if role is Role.COLOCATED else "split"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# The routers balance at the scale of a rollout batch, as the simulator's router does
# (controlplane/core/routing.py): with SGLang's defaults, newly admitted workers would stay idle for
# the rest of the step, the batch's turns sticking to the workers that hold their prefixes.
REBALANCE_ARGS = ("--balance-abs-threshold", str(REBALANCE_MIN_EXTRA - 1),  # the router's test is strict
                  "--balance-rel-threshold", str(REBALANCE_RATIO))


@dataclass
class FrontDoorConfig:
    port: int
    host: str = "127.0.0.1"
    mode: str = "colocated"
    run_dir: str | None = None  # state.json and the children's logs
    hold_s: float = 120.0  # how long a request may wait for the current mode's workers
    max_held: int = 4096  # requests held at once; more are refused (503)
    max_resubmits: int = 64  # per request
    request_timeout_s: float = 3600.0
    register_timeout_s: float = 30.0
    drain_s: float = 60.0  # at SIGTERM: how long the requests in flight may take to finish
    admin_port: int = 0  # the admin API's port (0: any free one)
    admin_host: str = "127.0.0.1"
    token: str | None = field(default=None, repr=False)  # the admin API's bearer token (None: open)
    python: str = sys.executable
    router_args: tuple[str, ...] = ("--log-level", "warn", *REBALANCE_ARGS)


@dataclass
class Registration:
    url: str
    role: Role
    bootstrap_port: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role.value, "bootstrap_port": self.bootstrap_port}


@dataclass
class Child:
    """One sglang-router process."""

    mode: str
    port: int
    prometheus_port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    workers: dict[str, Registration] = field(default_factory=dict)  # url -> registration (what pearl asked)
    restarting: bool = False  # it died and is being started again: requests for it are held
    started: float = 0.0  # time.monotonic() of its start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, cfg: FrontDoorConfig) -> None:
        argv = [cfg.python, "-m", "pearl.agents.router_process", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(self.prometheus_port), *cfg.router_args]
        if self.mode == "split":
            argv.append("--pd-disaggregation")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()  # the supervisor's clock
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def ready(self) -> bool:
        """Whether requests can be served: a regular worker, or a prefill and a decode one."""
        if self.restarting:
            return False
        roles = {r.role for r in self.workers.values()}
        return Role.COLOCATED in roles if self.mode == "colocated" else {Role.PREFILL, Role.DECODE} <= roles


class FrontDoor:
    def __init__(self, cfg: FrontDoorConfig) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"mode: one of {MODES}, not {cfg.mode!r}")
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir or Path.cwd() / "frontdoor")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = cfg.mode
        self.children = {m: Child(m, free_port(), free_port(), self.run_dir / f"router-{m}.log") for m in MODES}
        self.changed = asyncio.Condition()
        self.session: aiohttp.ClientSession | None = None
        self.held = 0
        self.inflight = 0
        self.admin_port: int | None = None  # the admin API's, once bound (`--admin-port 0`: the system's pick)
        self.served = self.resubmits = self.failed = 0
        self.admin_lock = asyncio.Lock()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=5))
        for child in self.children.values():
            child.start(self.cfg)
        deadline = time.monotonic() + 60
        for child in self.children.values():
            await self._answering(child, deadline)
        await self._restore()

    async def _answering(self, child: Child, deadline: float) -> None:
        """Wait until a started child answers."""
        while True:
            if child.proc.poll() is not None:
                raise RuntimeError(f"router {child.mode} exited ({child.proc.returncode}); see {child.log_path}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with self.session.get(child.url + "/workers", timeout=ADMIN_TIMEOUT) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {child.mode} did not answer in 60 s; see {child.log_path}")
            await asyncio.sleep(0.2)

    async def supervise(self, stop: asyncio.Event, every_s: float = 0.5,
                        clock: Callable[[], float] = time.monotonic) -> None:
        """Until `stop`: a child router that exited (killed, crashed) is started again, on new ports, and
        given back the workers it had. Meanwhile requests for it are held (`Child.restarting`), and one
        it dropped got no answer, which is retried, so none fails for it. A child that dies again within
        `STABLE_S` of its start, or whose restart fails, waits 2, 4, ... up to 30 s before the next."""
        failures = {mode: 0 for mode in self.children}
        next_try = {mode: 0.0 for mode in self.children}
        missed = {mode: 0 for mode in self.children}
        next_probe = clock() + PROBE_EVERY_S
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            if stop.is_set():
                return
            if clock() >= next_probe:
                next_probe = clock() + PROBE_EVERY_S
                await self._probe(missed)
            for child in self.children.values():
                if child.proc is None or child.proc.poll() is None:
                    continue
                if not child.restarting:  # just found dead
                    child.restarting = True
                    stable = clock() - child.started >= STABLE_S
                    failures[child.mode] = 0 if stable else failures[child.mode] + 1
                    wait_s = min(30.0, 2.0 ** failures[child.mode]) if failures[child.mode] else 0.0
                    next_try[child.mode] = clock() + wait_s
                    print(f"front door: router {child.mode} exited ({child.proc.returncode}); starting it again"
                          + (f" in {wait_s:.0f} s" if wait_s else ""), file=sys.stderr, flush=True)
                if clock() < next_try[child.mode]:
                    continue
                async with self.admin_lock:
                    try:
                        await self._restart(child)
                    except Exception as exc:  # noqa: BLE001 - whatever it was, stop it and try again later
                        failed_at = clock()  # the back-off counts from the failure, not from the cleanup
                        await asyncio.to_thread(child.stop)
                        failures[child.mode] += 1
                        wait_s = min(30.0, 2.0 ** failures[child.mode])
                        next_try[child.mode] = failed_at + wait_s
                        print(f"front door: router {child.mode}: {type(exc).__name__}: {exc}; trying again in "
                              f"{wait_s:.0f} s", file=sys.stderr, flush=True)

    async def _probe(self, missed: dict[str, int]) -> None:
        """Ask every running child `/workers` at once; one that misses `HUNG_PROBES` answers in a row is
        alive but hung (a SIGSTOP, a deadlock): it is killed, and the supervisor starts it again as it
        does a child that exited (its requests get no answer and are sent again)."""
        async def answers(child: Child) -> bool:
            try:
                async with self.session.get(child.url + "/workers", timeout=PROBE_TIMEOUT) as resp:
                    return resp.status < 500
            except (TimeoutError, aiohttp.ClientError, OSError):
                return False

        running = [c for c in self.children.values() if c.proc is not None and c.proc.poll() is None
                   and not c.restarting and self.session is not None]
        for child, ok in zip(running, await asyncio.gather(*(answers(c) for c in running)), strict=True):
            missed[child.mode] = 0 if ok else missed[child.mode] + 1
            if missed[child.mode] >= HUNG_PROBES:
                missed[child.mode] = 0
                print(f"front door: router {child.mode} (pid {child.proc.pid}) has not answered for "
                      f"{HUNG_PROBES} probes; killing it", file=sys.stderr, flush=True)
                child.proc.kill()  # SIGKILL ends a stopped process too

    async def _restart(self, child: Child) -> None:
        child.port, child.prometheus_port = free_port(), free_port()  # the old ones may linger
        child.start(self.cfg)  # from the event loop's thread: the parent-death signal follows this thread
        await self._answering(child, time.monotonic() + 60)
        regs = list(child.workers.values())
        results = await asyncio.gather(*(self._enlist(child, reg) for reg in regs), return_exceptions=True)
        for reg, result in zip(regs, results, strict=True):
            if isinstance(result, BaseException):  # a worker that no longer answers; its agent deregisters it
                print(f"front door: router {child.mode}: {reg.url}: {result}", file=sys.stderr, flush=True)
        child.restarting = False
        async with self.changed:
            self.changed.notify_all()
        back = sum(not isinstance(r, BaseException) for r in results)
        print(f"front door: router {child.mode} started again (pid {child.proc.pid}) with {back} of "
              f"{len(regs)} worker(s)", file=sys.stderr, flush=True)

    async def stop(self) -> None:
        for child in self.children.values():
            await asyncio.to_thread(child.stop)
        if self.session is not None:
            await self.session.close()

    def _state_path(self) -> Path:
        return self.run_dir / "state.json"

    def _save(self) -> None:
        workers = [r.to_dict() for c in self.children.values() for r in c.workers.values()]
        state = {"mode": self.mode, "workers": workers}
        tmp = self._state_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self._state_path())

    async def _restore(self) -> None:
        """A restarted front door: the mode and the workers it had, those that still answer."""
        path = self._state_path()
        if not path.exists():
            self._save()
            return
        try:
            state = json.loads(path.read_text())
            regs = [Registration(w["url"], Role(w["role"]), w.get("bootstrap_port")) for w in state["workers"]]
            self.mode = state.get("mode", self.mode) if state.get("mode") in MODES else self.mode
        except (ValueError, KeyError, TypeError) as exc:
            print(f"front door: ignoring unreadable {path}: {exc}", file=sys.stderr)
            return
        for reg in regs:
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with self.session.get(reg.url + "/health", timeout=aiohttp.ClientTimeout(total=3)) as resp:
                    if resp.status == 200:
                        with contextlib.suppress(RuntimeError):
                            await self.register(reg)
        self._save()

    # -- admin -----------------------------------------------------------------------------------

    async def _listed(self, child: Child) -> list[dict[str, Any]]:
        async with self.session.get(child.url + "/workers", timeout=ADMIN_TIMEOUT) as resp:
            resp.raise_for_status()
            return (await resp.json())["workers"]

    async def register(self, reg: Registration) -> dict[str, Any]:
        child = self.children[child_mode(reg.role)]
        if child.restarting:  # its restart registers every worker it records, this one included
            child.workers[reg.url] = reg
            self._save()
            return {"id": None, "router": child.mode, "pending": True, **reg.to_dict()}
        return await self._enlist(child, reg)

    async def _enlist(self, child: Child, reg: Registration) -> dict[str, Any]:
        """Register with a running child; returns once it lists the worker."""
        deadline = time.monotonic() + self.cfg.register_timeout_s
        for entry in await self._listed(child):
            if entry["url"] == reg.url and entry["worker_type"] != WORKER_TYPE[reg.role]:
                await self._delete(child, entry["id"], reg.url, deadline)  # re-registered under another role
        posted = False
        while True:
            for entry in await self._listed(child):
                if entry["url"] == reg.url and entry.get("is_healthy", True):
                    child.workers[reg.url] = reg
                    self._save()
                    async with self.changed:
                        self.changed.notify_all()
                    return {"id": entry["id"], "router": child.mode, **reg.to_dict()}
            if not posted:
                body: dict[str, Any] = {"url": reg.url, "worker_type": WORKER_TYPE[reg.role]}
                if reg.bootstrap_port is not None:
                    body["bootstrap_port"] = reg.bootstrap_port
                async with self.session.post(child.url + "/workers", json=body) as resp:
                    if resp.status >= 400:
                        raise RuntimeError(f"router {child.mode} refused {reg.url}: {await resp.text()}")
                posted = True
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {child.mode} did not list {reg.url} within "
                                   f"{self.cfg.register_timeout_s:.0f} s (does it answer /health and /model_info?)")
            await asyncio.sleep(0.05)

    async def _delete(self, child: Child, worker_id: str, url: str, deadline: float) -> None:
        async with self.session.delete(f"{child.url}/workers/{worker_id}") as resp:
            if resp.status >= 400 and resp.status != 404:
                raise RuntimeError(f"router {child.mode} refused to remove {url}: {await resp.text()}")
        while any(e["url"] == url for e in await self._listed(child)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {child.mode} still lists {url}")
            await asyncio.sleep(0.05)

    async def deregister(self, url: str) -> bool:
        """Remove `url` from whichever child lists it; True if one did."""
        found = False
        deadline = time.monotonic() + self.cfg.register_timeout_s
        for child in self.children.values():
            popped = child.workers.pop(url, None)
            if child.restarting:  # its restart registers only the workers it still records
                found = found or popped is not None
                continue
            for entry in await self._listed(child):
                if entry["url"] == url:
                    found = True
                    await self._delete(child, entry["id"], url, deadline)
        self._save()
        return found

    async def set_mode(self, mode: str) -> None:
        self.mode = mode
        self._save()
        async with self.changed:
            self.changed.notify_all()

    async def sync(self, mode: str | None, regs: list[Registration]) -> None:
        wanted = {r.url: r for r in regs}
        for child in self.children.values():
            listed = list(child.workers) if child.restarting else [e["url"] for e in await self._listed(child)]
            for url in listed:
                reg = wanted.get(url)
                if reg is None or child_mode(reg.role) != child.mode:
                    await self.deregister(url)
        for reg in regs:
            await self.register(reg)
        if mode is not None:
            await self.set_mode(mode)

    async def state(self) -> dict[str, Any]:
        children = {}
        for mode, child in self.children.items():
            try:
                listed = await self._listed(child)
            except (aiohttp.ClientError, OSError) as exc:
                listed, error = [], str(exc)
            else:
                error = None
            children[mode] = {
                "url": child.url, "pid": child.proc.pid if child.proc else None, "ready": child.ready(),
                "restarting": child.restarting,
                "error": error,
                "workers": [{"url": e["url"], "worker_type": e["worker_type"], "healthy": e.get("is_healthy"),
                             "bootstrap_port": e.get("bootstrap_port"), "load": e.get("load")} for e in listed],
            }
        return {"url": f"http://{self.cfg.host}:{self.cfg.port}", "admin_port": self.admin_port, "mode": self.mode,
                "pid": os.getpid(),
                "held": self.held, "inflight": self.inflight, "served": self.served,
                "resubmits": self.resubmits, "failed": self.failed, "children": children}

    # -- requests --------------------------------------------------------------------------------

    async def _child(self, deadline: float) -> Child | None:
        """The current mode's child once it can serve; None past the deadline or when too many wait."""
        child = self.children[self.mode]
        if child.ready():
            return child
        if self.held >= self.cfg.max_held:
            return None
        self.held += 1
        try:
            async with self.changed:
                while not self.children[self.mode].ready():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), left)
            return self.children[self.mode]
        finally:
            self.held -= 1

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object"}}, status=400)
        self.inflight += 1
        try:
            if body.get("stream"):
                return await self._passthrough(request, body)
            return await self._generate(body)
        finally:
            self.inflight -= 1

    async def _generate(self, body: dict[str, Any]) -> web.Response:
        params = dict(body.get("sampling_params") or {})
        budget = params.get("max_new_tokens", 128)
        ids = body.get("input_ids")
        text = body.get("text")
        kept: list[int] = []
        kept_text = ""
        resubmits = kept_from_aborts = 0
        deadline = time.monotonic() + self.cfg.hold_s
        attempt_body = body
        last_error = "no router answered"
        while True:
            child = await self._child(deadline)
            if child is None:
                self.failed += 1
                return web.json_response({"error": {"message": f"no {self.mode} worker to serve the request within "
                                                               f"{self.cfg.hold_s:.0f} s ({last_error})"}},
                                         status=503)
            try:
                async with self.session.post(child.url + "/generate", json=attempt_body) as resp:
                    status, raw = resp.status, await resp.read()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                status, raw = None, str(exc).encode()
            if status in RETRYABLE or status is None:
                last_error = f"{child.mode} router: {status or 'no answer'}: {raw[:200].decode(errors='replace')}"
                if time.monotonic() > deadline or resubmits >= self.cfg.max_resubmits:
                    self.failed += 1
                    return web.json_response({"error": {"message": last_error}}, status=status or 502)
                resubmits += 1
                self.resubmits += 1
                await asyncio.sleep(min(0.5, 0.02 * resubmits))
                continue
            if status != 200:
                return web.Response(status=status, body=raw, content_type="application/json")
            answer = json.loads(raw)
            meta = answer.setdefault("meta_info", {})
            reason = (meta.get("finish_reason") or {}).get("type")
            out = answer.get("output_ids") or []
            left = budget - len(kept) - len(out) if isinstance(budget, int) else 0
            if reason == "abort" and left > 0 and resubmits < self.cfg.max_resubmits and (ids is not None or text):
                kept += out
                kept_text += answer.get("text") or ""
                kept_from_aborts += len(out)
                resubmits += 1
                self.resubmits += 1
                attempt_body = {**body, "sampling_params": {**params, "max_new_tokens": left}}
                if ids is not None:
                    attempt_body["input_ids"] = list(ids) + kept
                else:
                    attempt_body["text"] = text + kept_text
                deadline = time.monotonic() + self.cfg.hold_s
                continue
            if kept:
                answer["output_ids"] = kept + out
                answer["text"] = kept_text + (answer.get("text") or "")
                meta["completion_tokens"] = len(answer["output_ids"])
                if ids is not None:
                    meta["prompt_tokens"] = len(ids)
            meta["pearl"] = {"resubmitted": resubmits, "kept_tokens": kept_from_aborts, "router": child.mode}
            self.served += 1
            return web.json_response(answer)

    async def _passthrough(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """A streamed request: sent again while its router gives no answer (a restart); once the stream
        has begun it is the client's (a stream cut midway is not resumed)."""
        deadline = time.monotonic() + self.cfg.hold_s
        while True:
            child = await self._child(deadline)
            if child is None:
                return web.json_response({"error": {"message": f"no {self.mode} worker"}}, status=503)
            try:
                resp = await self.session.post(child.url + "/generate", json=body)
            except (aiohttp.ClientConnectionError, OSError) as exc:
                if time.monotonic() > deadline:
                    return web.json_response({"error": {"message": f"{child.mode} router: no answer: {exc}"}},
                                             status=502)
                await asyncio.sleep(0.2)
                continue
            async with resp:
                out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.content_type})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out


def _reads(door: FrontDoor) -> web.RouteTableDef:
    """What both ports answer: health and the state."""
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    @routes.get("/pearl/state")
    async def state(request: web.Request) -> web.Response:
        return web.json_response(await door.state())

    return routes


def build_app(door: FrontDoor) -> web.Application:
    """The clients' port: generation, health and the state (read-only)."""
    routes = _reads(door)

    @routes.post("/generate")
    async def generate(request: web.Request) -> web.StreamResponse:
        return await door.generate(request)

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.add_routes(routes)
    return app


def _bearer_auth(token: str | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if token and request.path != "/health":
            scheme, _, given = (request.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
                return web.json_response({"error": {"message": "Unauthorized: the admin API needs the control "
                                                               "token"}}, status=401)
        return await handler(request)
    return check


def build_admin_app(door: FrontDoor) -> web.Application:
    """The admin API (module docstring), behind the token when there is one."""
    routes = _reads(door)

    async def body_of(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="body is not JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="body must be a JSON object")
        return body

    def registration(raw: Any, where: str) -> Registration:
        if not isinstance(raw, dict) or not isinstance(raw.get("url"), str):
            raise web.HTTPBadRequest(text=f"{where}.url: required")
        try:
            role = Role(raw.get("role", "colocated"))
            if role not in WORKER_TYPE:
                raise ValueError
        except ValueError:
            raise web.HTTPBadRequest(text=f"{where}.role: one of colocated, prefill, decode") from None
        port = raw.get("bootstrap_port")
        if port is not None and not isinstance(port, int):
            raise web.HTTPBadRequest(text=f"{where}.bootstrap_port: an integer")
        if role is Role.PREFILL and port is None:
            raise web.HTTPBadRequest(text=f"{where}.bootstrap_port: required for a prefill worker")
        return Registration(raw["url"].rstrip("/"), role, port)

    def mode_of(raw: Any, where: str) -> str:
        if raw not in MODES:
            raise web.HTTPBadRequest(text=f"{where}: one of {', '.join(MODES)}, not {raw!r}")
        return raw

    @routes.post("/pearl/workers")
    async def add(request: web.Request) -> web.Response:
        reg = registration(await body_of(request), "body")
        async with door.admin_lock:
            try:
                return web.json_response(await door.register(reg))
            except RuntimeError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=502)

    @routes.delete("/pearl/workers")
    async def remove(request: web.Request) -> web.Response:
        url = (await body_of(request)).get("url")
        if not isinstance(url, str):
            raise web.HTTPBadRequest(text="body.url: required")
        async with door.admin_lock:
            try:
                return web.json_response({"removed": await door.deregister(url.rstrip("/")), "url": url})
            except RuntimeError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=502)

    @routes.put("/pearl/mode")
    async def mode(request: web.Request) -> web.Response:
        new = mode_of((await body_of(request)).get("mode"), "body.mode")
        async with door.admin_lock:
            await door.set_mode(new)
        return web.json_response({"mode": door.mode})

    @routes.put("/pearl/workers")
    async def sync(request: web.Request) -> web.Response:
        body = await body_of(request)
        new = mode_of(body["mode"], "body.mode") if body.get("mode") is not None else None
        raw = body.get("workers")
        if not isinstance(raw, list):
            raise web.HTTPBadRequest(text="body.workers: a list")
        regs = [registration(w, f"body.workers.{i}") for i, w in enumerate(raw)]
        async with door.admin_lock:
            try:
                await door.sync(new, regs)
            except RuntimeError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=502)
        return web.json_response(await door.state())

    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[_bearer_auth(door.cfg.token)])
    app.add_routes(routes)
    return app


async def serve(cfg: FrontDoorConfig, started: Callable[[FrontDoor], Callable[[], None]] | None = None) -> None:
    """Run the front door and its two routers until SIGTERM or SIGINT. `started(door)`, once the
    routers run, returns what to call at the end (the metrics server's stop)."""
    door = FrontDoor(cfg)
    ended: Callable[[], None] = lambda: None  # noqa: E731
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first asks for a drain, a second for an end now
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    runner = web.AppRunner(build_app(door), handle_signals=False, shutdown_timeout=5.0, access_log=None)
    admin = web.AppRunner(build_admin_app(door), handle_signals=False, shutdown_timeout=5.0, access_log=None)
    try:
        await door.start()
        if started is not None:
            ended = started(door)
        await runner.setup()
        await admin.setup()
        public_site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
        await public_site.start()
        admin_site = web.TCPSite(admin, cfg.admin_host, cfg.admin_port, reuse_address=True)
        await admin_site.start()
        door.admin_port = admin_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"front door on http://{cfg.host}:{cfg.port} (mode {door.mode}), admin API on "
              f"http://{cfg.admin_host}:{door.admin_port}{'' if cfg.token else ' (no token)'}; routers: "
              + ", ".join(f"{m} {c.url} pid {c.proc.pid}" for m, c in door.children.items()),
              file=sys.stderr, flush=True)
        supervisor = asyncio.create_task(door.supervise(hurry))
        await stop.wait()
        # no new requests; those in flight (and held) finish, their routers still supervised, within
        # `drain_s` (a second signal ends the wait); the admin API stays up for the agents meanwhile
        print(f"front door: stopping: {door.inflight} request(s) in flight, up to {cfg.drain_s:g} s to finish",
              file=sys.stderr, flush=True)
        await public_site.stop()
        deadline = loop.time() + cfg.drain_s
        while (door.inflight or door.held) and loop.time() < deadline and not hurry.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hurry.wait(), 0.05)
        hurry.set()
        supervisor.cancel()  # a restart under way stops too: its child is stopped with the others
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
        print("front door: stopping", file=sys.stderr, flush=True)
        await admin.cleanup()
        await runner.cleanup()
    finally:
        ended()
        await door.stop()
