"""The simulated server's engine in real time: `pearl.sim.engine.Engine` driven by the wall clock.

The simulator's continuous-batching engine advances in closed form between events; here the events
are HTTP requests and timers, and simulated time is wall time since start multiplied by `speed`
(time compression: at speed 10 a 2 s decode takes 0.2 s). Whenever the engine's work in flight ends
(`busy_until`), a timer applies it; any request first brings the engine up to now.

One request of `/generate` is one `Request` of one turn. Its trajectory key comes from a prefix index
over the token ids: the next turn of a trajectory starts with the tokens of the previous turn (its
input and output ids), so it finds that trajectory's cached prefix on this server, as SGLang's radix
cache would.

Split serving: a prefill server prefills and holds the KV; the decode server of the same request
(matched by the router's `bootstrap_room`) reserves room, then pulls the KV from the prefill server's
bootstrap port (`POST /pearl/kv/{room}`), which answers once the prefill is done and the transfer,
timed by `PerfModel.kv_transfer_time` over the prefill server's NIC (one transfer at a time), ends.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.sim.engine import ABORTED, PREFILLED, TRANSFERRING, Engine, EngineTiming, Request
from pearl.sim.trajectories import Trajectory

PREFIX_HEAD = 16  # tokens hashed to find candidate trajectories
PREFIX_ENTRIES = 20000  # prefix index entries kept (least recently used dropped)
KV_WAIT_S = 120.0  # wall seconds a prefill server holds a prefilled KV for its decode server to pull it
VOCAB = 32000


class PrefixIndex:
    """Which earlier turn's tokens (input + output) are a prefix of a new request's input ids."""

    def __init__(self, entries: int = PREFIX_ENTRIES) -> None:
        self.entries = entries
        self.by_head: OrderedDict[int, list[tuple[int, int, int]]] = OrderedDict()  # head -> (len, hash, key)
        self.count = 0

    def find(self, ids: list[int]) -> int | None:
        head = hash(tuple(ids[:PREFIX_HEAD]))
        for n, h, key in reversed(self.by_head.get(head, ())):
            if n <= len(ids) and hash(tuple(ids[:n])) == h:
                self.by_head.move_to_end(head)
                return key
        return None

    def add(self, ids: list[int], key: int) -> None:
        head = hash(tuple(ids[:PREFIX_HEAD]))
        entry = (len(ids), hash(tuple(ids)), key)
        bucket = self.by_head.setdefault(head, [])
        bucket[:] = [e for e in bucket if e[2] != key][-15:] + [entry]
        self.by_head.move_to_end(head)
        self.count += 1
        while len(self.by_head) > self.entries:
            self.by_head.popitem(last=False)


@dataclass(eq=False)
class Pending:
    """One `/generate` request held by this server."""

    req: Request
    ids: list[int]
    rid: str
    started: float  # wall clock
    room: int | None = None
    bootstrap: tuple[str, int] | None = None
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)  # prefill side: KV ready to move
    pull: asyncio.Task | None = None  # decode side: the KV pull in flight


class RealtimeEngine:
    """One engine, its requests and its timers, in simulated time `speed` times faster than the wall."""

    def __init__(self, perf: PerfModel, role: Role, speed: float, worker_id: int = 0,
                 capacity: int | None = None) -> None:
        self.perf = perf
        self.timings = {r: EngineTiming(perf.for_role(r)) for r in (Role.COLOCATED, Role.PREFILL, Role.DECODE)}
        self.speed = speed
        self.worker_id = worker_id
        self.capacity = capacity or perf.kv_capacity_tokens
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.engine = Engine(worker_id, role, self.timings[role], self.capacity)
        self.prefixes = PrefixIndex()
        self.keys = itertools.count()
        self.seq = itertools.count(1)
        self.pending: dict[int, Pending] = {}  # by Request.seq
        self.rooms: dict[int, Pending] = {}  # prefill side: bootstrap room -> request
        self.room_waiters: dict[int, asyncio.Future] = {}  # prefill side: pulls that came before the request
        self.nic_free = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.session: aiohttp.ClientSession | None = None
        self.finished = self.aborted = 0
        self.tokens_out = 0

    # -- time ------------------------------------------------------------------------------------

    @property
    def role(self) -> Role:
        return self.engine.role

    def now(self) -> float:
        return (self.loop.time() - self.t0) * self.speed

    async def sleep_sim(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds / self.speed)

    def _catch_up(self) -> float:
        """Apply every piece of work that ended by now; return now (simulated seconds)."""
        now = self.now()
        eng = self.engine
        while eng.busy_until is not None and eng.busy_until <= now:
            self._outcomes(eng.wake(eng.busy_until))
        return now

    def _arm(self) -> None:
        eng = self.engine
        if eng.busy_until is None or eng.armed == eng.epoch:
            return
        eng.armed = eng.epoch
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(self.t0 + eng.busy_until / self.speed, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        self._catch_up()
        self._arm()

    # -- requests --------------------------------------------------------------------------------

    def new_request(self, ids: list[int], max_new: int, rid: str) -> Pending:
        key = self.prefixes.find(ids)
        if key is None:
            key = next(self.keys)
        traj = Trajectory(key, 0, key, len(ids), [max_new], [], [], False)
        req = Request(traj, next(self.seq), max_new)
        return Pending(req, ids, rid, time.monotonic())

    def submit(self, p: Pending) -> None:
        now = self._catch_up()
        self.pending[p.req.seq] = p
        if self.role is Role.PREFILL and p.room is not None:
            self.rooms[p.room] = p
            waiter = self.room_waiters.pop(p.room, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(p)
        self._outcomes(self.engine.submit(p.req, now))
        self._arm()

    def result(self, p: Pending, reason: str, message: str | None = None) -> dict[str, Any]:
        """The `/generate` answer for what the request generated here."""
        n = p.req.traj.turn_generated
        rng = random.Random(hash((p.rid, len(p.ids))))
        out = [rng.randrange(100, VOCAB) for _ in range(n)]
        if reason == "length":
            finish: dict[str, Any] = {"type": "length", "length": n}
            if self.role is not Role.PREFILL:
                self.prefixes.add(p.ids + out, p.req.traj.id)
        else:
            finish = {"type": "abort", "message": message or "Aborted", "status_code": None, "err_type": None}
        return {
            "text": "",
            "output_ids": out,
            "meta_info": {
                "id": p.rid,
                "finish_reason": finish,
                "prompt_tokens": len(p.ids),
                "completion_tokens": n,
                "cached_tokens": p.req.cached,
                "e2e_latency": time.monotonic() - p.started,
            },
        }

    def _finish(self, p: Pending, reason: str, message: str | None = None) -> None:
        self.pending.pop(p.req.seq, None)
        if p.room is not None and self.rooms.get(p.room) is p:
            del self.rooms[p.room]
        if p.pull is not None and not p.pull.done() and p.pull is not asyncio.current_task():
            p.pull.cancel()
        if reason == "length":
            self.finished += 1
            self.tokens_out += p.req.traj.turn_generated
        else:
            self.aborted += 1
        if not p.done.done():
            p.done.set_result(self.result(p, reason, message))

    def _outcomes(self, out: list[tuple[str, Request]]) -> None:
        for what, req in out:
            p = self.pending.get(req.seq)
            if p is None:
                continue
            if what == "done":
                self._finish(p, "length")
            elif what == "prefilled":
                p.prefilled.set()
                self.loop.call_later(KV_WAIT_S, self._expire, p)
            elif what == "retracted":
                self._finish(p, "abort", "retracted: the decode server ran out of KV cache")
            else:  # reserved on this decode server: pull the KV from the prefill server
                p.pull = self.loop.create_task(self._pull(p))

    def _expire(self, p: Pending) -> None:
        if p.req.seq in self.pending and p.req.state == PREFILLED:
            self.cancel(p, "no decode server took the KV in time")

    def cancel(self, p: Pending, message: str) -> None:
        """Drop one request (its other half went away) and answer it aborted."""
        now = self._catch_up()
        if p.req.state != ABORTED:
            self._outcomes(self.engine.cancel(p.req, now))
        self._finish(p, "abort", message)
        self._arm()

    def interrupt(self, message: str = "Aborted by pause_generation") -> int:
        """Abort everything in flight; each answer carries the tokens generated so far."""
        now = self._catch_up()
        aborted, done = self.engine.interrupt(now)
        self._outcomes(done)
        for req in aborted:
            p = self.pending.get(req.seq)
            if p is not None:
                self._finish(p, "abort", message)
        for p in list(self.pending.values()):  # e.g. zero-token requests not in the engine
            self._finish(p, "abort", message)
        self._arm()
        return len(aborted)

    def pause(self, until_sim: float) -> None:
        now = self._catch_up()
        self._outcomes(self.engine.pause(now, until_sim))
        self._arm()

    def resume(self) -> None:
        now = self._catch_up()
        self._outcomes(self.engine.resume(now))
        self._arm()

    def set_role(self, role: Role) -> None:
        """A new engine in `role` (only when idle: the KV and the prefix cache are rebuilt)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.engine = Engine(self.worker_id, role, self.timings[role], self.capacity)
        self.prefixes = PrefixIndex()

    def flush_cache(self) -> None:
        kv = self.engine.kv
        kv.cached.clear()
        kv.cached_tokens = 0
        self.prefixes = PrefixIndex()

    @property
    def idle(self) -> bool:
        return not self.pending and self.engine.idle

    # -- split serving ---------------------------------------------------------------------------

    async def _pull(self, p: Pending) -> None:
        """Decode side: fetch the request's KV from its prefill server, then join the batch."""
        host, port = p.bootstrap or ("", 0)
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        try:
            async with self.session.post(f"http://{host}:{port}/pearl/kv/{p.room}",
                                         json={"context": p.req.context}) as resp:
                answer = await resp.json(content_type=None)
                ok = resp.status == 200 and answer.get("ok")
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            ok, answer = False, {"message": f"KV pull from {host}:{port} failed: {exc}"}
        if p.req.seq not in self.pending:
            return
        if not ok:
            self.cancel(p, answer.get("message") or "the prefill server aborted the request")
            return
        now = self._catch_up()
        if p.req.state == TRANSFERRING:
            self._outcomes(self.engine.join(p.req, now))
            self._arm()

    async def serve_pull(self, room: int) -> dict[str, Any]:
        """Prefill side: hand the KV of `room` to its decode server once prefilled, after the transfer."""
        p = self.rooms.get(room)
        if p is None:
            waiter = self.room_waiters.setdefault(room, self.loop.create_future())
            try:
                p = await asyncio.wait_for(asyncio.shield(waiter), KV_WAIT_S)
            except TimeoutError:
                self.room_waiters.pop(room, None)
                return {"ok": False, "message": f"no request with bootstrap_room {room} on this prefill server"}
        waits = [self.loop.create_task(p.prefilled.wait())]
        try:
            await asyncio.wait([*waits, p.done], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waits[0].cancel()
        if p.done.done() or p.req.state != PREFILLED:
            return {"ok": False, "message": "the prefill server aborted the request"}
        now = self._catch_up()
        start = max(now, self.nic_free)
        end = start + self.perf.kv_transfer_time(p.req.context)
        self.nic_free = end
        await self.sleep_sim(end - now)
        if p.done.done() or p.req.seq not in self.pending:
            return {"ok": False, "message": "the prefill server aborted the request"}
        now = self._catch_up()
        self._outcomes(self.engine.transferred(p.req, now))
        self._finish(p, "length")
        self._arm()
        return {"ok": True, "context": p.req.context}

    async def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.session is not None:
            await self.session.close()

    # -- load ------------------------------------------------------------------------------------

    def load(self, held: int = 0) -> dict[str, Any]:
        """One `/v1/loads` entry (SGLang's LoadSnapshot fields that apply)."""
        eng = self.engine
        running = eng.batch + len(eng.joining) + len(eng.prefilling)
        waiting = len(eng.waiting) + held
        used = eng.kv.used
        split = eng.role is not Role.COLOCATED
        return {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "num_total_tokens": eng.kv.reserved,
            "max_total_num_tokens": self.capacity,
            "token_usage": round(used / self.capacity, 4) if self.capacity else 0.0,
            "gen_throughput": 0.0,
            "utilization": 0.0 if eng.idle else 1.0,
            "disaggregation": {
                "mode": eng.role.value if split else "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": len(eng.awaiting),
                "decode_prealloc_queue_reqs": len(eng.waiting) if eng.role is Role.DECODE else 0,
                "decode_transfer_queue_reqs": len(eng.inbound),
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": self.perf.gpu.nic_gbps * self.perf.tp if split else 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {"waiting": waiting, "grammar": 0, "paused": held, "retracted": eng.retractions,
                       "prealloc_ready": 0},
        }
