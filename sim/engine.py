"""One rollout worker's continuous-batching engine, each iteration timed by the performance model.

The scheduler is SGLang's default (no mixed chunks): whenever requests wait and their KV fits, the
next iteration is a prefill batch of up to `PREFILL_CHUNK_TOKENS` new tokens (requests packed, a
long one chunked over several iterations) and the running decodes pause for it; otherwise every
running sequence decodes one token. That pause is how prefill interferes with decode on a colocated
worker. A prefill worker only prefills, then holds the KV until it is transferred; a decode worker
only decodes sequences whose KV it received.

KV, as SGLang manages it (`KVCache` holds the reservations and the prefix cache): a request is
admitted when its context fits beside what the running sequences are expected to add, an estimate of
`new_token_ratio` x min(max_new_tokens left, 4096) per sequence; the ratio starts at 0.7 and decays
to 0.1 over 600 decode iterations (SGLang's defaults). A decode worker preallocates the context plus
512 tokens per sequence it holds. Decode grows the KV by one token per sequence per iteration; when
it runs out, the sequences with the fewest generated tokens are retracted (colocated: back to the
queue, to be prefilled again; decode worker: back to the router), keeping their progress, and the
ratio is reset from what the others still need. Finished turns leave their context cached on
colocated and prefill workers (prefix cache); the next turn of the same trajectory there prefills
only what is new.

Speed: decode advances in closed form. With B sequences of summed context S, an iteration takes
alpha(B) + beta*S (`PerfModel.iteration_time` is affine in the context), and S grows by B per
iteration, so k iterations take k*(alpha + beta*S) + beta*B*k*(k-1)/2. A stretch runs to the first
sequence that finishes its turn; anything arriving earlier ends it at the next iteration boundary.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from pearl.controlplane.core import perfmodel
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import PerfModel

from .kvcache import KVCache, group_key
from .trajectories import Trajectory

PREFILL_CHUNK_TOKENS = 8192  # SGLang's chunked_prefill_size on 80 GB GPUs
# SGLang scheduler defaults (global_config / scheduler): admission estimate and retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # per decode iteration
CLIP_MAX_NEW_TOKENS = 4096  # cap of max_new_tokens in the admission estimate
RETRACT_DECODE_STEPS = 20  # a retraction frees room for this many more iterations
DECODE_RESERVED_TOKENS = 512  # PD decode worker: tokens preallocated per sequence beyond its context

# Request states.
WAITING = 0  # queued for prefill (colocated or prefill worker)
PREFILLING = 1  # admitted, being prefilled
PREFILLED = 2  # prefill worker holds its KV; waiting for a decode worker's reservation
TRANSFERRING = 3  # decode worker reserved; KV on the wire
DECODING = 4  # in a decode batch (or joining it at the next iteration)
FINISHED = 5  # the turn's generation ended
ABORTED = 6  # interrupted; the trajectory keeps what it generated

# What an engine was doing until `busy_until`.
IDLE, PREFILL, DECODE, PAUSE = range(4)


class Request:
    """One turn (or the rest of an interrupted turn) of one trajectory."""

    __slots__ = ("traj", "context", "gen", "max_new", "cached", "prefilled", "state", "engine", "prefill_engine",
                 "kv", "kv_prefill", "join_counter", "seq")

    def __init__(self, traj: Trajectory, seq: int, max_new: int | None = None) -> None:
        self.traj = traj
        self.context = traj.context + traj.turn_generated  # tokens in KV before it generates
        self.gen = traj.gen[traj.turn] - traj.turn_generated  # tokens left to generate in this turn
        self.max_new = self.gen if max_new is None else max(max_new, self.gen)  # the request's max_new_tokens
        self.cached = 0  # tokens of the context found in the prefix cache
        self.prefilled = 0  # tokens prefilled so far, the cached ones included
        self.state = WAITING
        self.engine: Engine | None = None  # the colocated or decode worker that generates
        self.prefill_engine: Engine | None = None  # split mode: the prefill worker
        self.kv = 0  # tokens reserved on `engine` when admitted (its context; decode adds to it)
        self.kv_prefill = 0  # tokens reserved on `prefill_engine`
        self.join_counter = 0  # the engine's decode counter when the request joined the batch
        self.seq = seq  # unique, for deterministic ordering


class EngineTiming:
    """Iteration times of one worker type, with the decode terms cached per batch size."""

    def __init__(self, perf: PerfModel, chunk: int = PREFILL_CHUNK_TOKENS) -> None:
        self.perf = perf
        self.chunk = chunk
        self.beta = perf.decode_attention_time(1.0)  # seconds per context token per decode iteration
        self._alpha: dict[int, float] = {}

    def alpha(self, batch: int) -> float:
        a = self._alpha.get(batch)
        if a is None:
            a = self._alpha[batch] = self.perf.iteration_time(decode_batch=batch)
        return a

    def decode_time(self, batch: int, ctx_sum: float, k: int) -> float:
        """Time of k decode iterations starting from summed context `ctx_sum`."""
        return k * (self.alpha(batch) + self.beta * ctx_sum) + self.beta * batch * k * (k - 1) / 2

    def decode_iters_by(self, batch: int, ctx_sum: float, elapsed: float) -> int:
        """Whole decode iterations completed within `elapsed` seconds."""
        if elapsed <= 0:
            return 0
        a2 = self.beta * batch / 2
        b1 = self.alpha(batch) + self.beta * ctx_sum - a2
        k = int(elapsed / b1) if a2 == 0 else int((-b1 + math.sqrt(b1 * b1 + 4 * a2 * elapsed)) / (2 * a2))
        while self.decode_time(batch, ctx_sum, k + 1) <= elapsed:
            k += 1
        while k > 0 and self.decode_time(batch, ctx_sum, k) > elapsed:
            k -= 1
        return k

    def prefill_iteration(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill batch: (new tokens, tokens before them in the context) per request."""
        tokens = sum(n for n, _ in chunks)
        att = sum(self.perf.prefill_attention_time(n, before) for n, before in chunks)
        return self.perf.iteration_time(prefill_tokens=tokens, prefill_attention_s=att)


class Engine:
    """A worker's engine in one role. The runner calls it at `busy_until` (`wake`) and on changes."""

    def __init__(self, worker: int, role: Role, timing: EngineTiming, capacity: int,
                 sink: list | None = None, prefix_cache: bool = True) -> None:
        self.worker = worker
        self.role = role
        self.prefix_cache = prefix_cache  # off: every turn prefills its whole context (radix cache disabled)
        self.timing = timing
        self.kv = KVCache(capacity)
        self.sink = sink  # iteration records (worker, role, batch, context mean, prefill tokens, seconds)
        self.waiting: deque[Request] = deque()  # prefill side: not admitted; decode side: no KV reserved yet
        self.prefilling: list[Request] = []
        self.awaiting: dict[int, Request] = {}  # prefill worker: prefilled, KV held until transferred
        self.inbound: dict[int, Request] = {}  # decode worker: reserved, KV on the wire
        self.joining: list[Request] = []  # join the decode batch at the next iteration boundary
        self.heap: list[tuple[int, int, Request]] = []  # (finish counter, seq, request) of the batch
        self.batch = 0
        self.ctx_sum = 0.0  # summed context of the decode batch
        self.counter = 0  # decode iterations run so far (a sequence's progress is counter - join_counter)
        self.kind = IDLE
        self.busy_until: float | None = None
        self.t0 = 0.0
        self.k_planned = 0
        self.plan: list[tuple[Request, int]] = []  # the prefill iteration in flight
        self.paused_until = 0.0
        self.ratio = INIT_NEW_TOKEN_RATIO  # SGLang's new_token_ratio
        self.retractions = 0
        self.epoch = 0  # bumped whenever busy_until changes; stale wake-ups are ignored
        self.armed = -1  # the epoch the runner last scheduled a wake-up for
        # what it did, for calibration and telemetry
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.prefill_s = 0.0
        self.decode_s = 0.0

    # -- load, for the router --------------------------------------------------------------------

    @property
    def load(self) -> int:
        """Requests it holds in any state."""
        return len(self.waiting) + len(self.prefilling) + len(self.awaiting) + len(self.inbound) + len(
            self.joining) + self.batch

    @property
    def idle(self) -> bool:
        return self.load == 0

    def decoding_progress(self) -> int:
        """Tokens the running sequences generated here so far (not yet credited to their trajectories)."""
        return sum(self.counter - req.join_counter for _, _, req in self.heap)

    # -- inputs ----------------------------------------------------------------------------------

    def submit(self, req: Request, now: float) -> list[tuple[str, Request]]:
        """A request for this worker: prefill it (colocated, prefill) or reserve its KV (decode)."""
        if self.role is Role.PREFILL:
            req.prefill_engine = self
        else:
            req.engine = self
        self.waiting.append(req)
        return self.kick(now)

    def join(self, req: Request, now: float) -> list[tuple[str, Request]]:
        """Decode worker: the request's KV arrived; it joins the batch at the next iteration."""
        del self.inbound[req.seq]
        req.state = DECODING
        self.joining.append(req)
        return self.kick(now)

    def transferred(self, req: Request, now: float) -> list[tuple[str, Request]]:
        """Prefill worker: the request's KV left; keep its prefix cached, free the reservation."""
        self.awaiting.pop(req.seq, None)
        self.kv.free(req.kv_prefill)
        req.kv_prefill = 0
        if self.prefix_cache:
            self.kv.store(req.traj.id, req.context)
        return self.kick(now)

    def cancel(self, req: Request, now: float) -> list[tuple[str, Request]]:
        """Forget a request aborted on its other worker (split mode) and free what it held here."""
        if req.prefill_engine is self and req.seq in self.awaiting:
            del self.awaiting[req.seq]
            self.kv.free(req.kv_prefill)
            req.kv_prefill = 0
        if req.engine is self:
            if req.seq in self.inbound:
                del self.inbound[req.seq]
                self.kv.free(req.kv)
                req.kv = 0
            elif req in self.waiting:
                self.waiting.remove(req)
        return self.kick(now)

    def pause(self, now: float, until: float) -> list[tuple[str, Request]]:
        """No iteration runs before `until` (weights being loaded); the one in flight completes."""
        self.paused_until = max(self.paused_until, until)
        return self.kick(now)

    def resume(self, now: float) -> list[tuple[str, Request]]:
        """End a pause before its time (a live server told to continue); the next iteration starts now."""
        self.paused_until = min(self.paused_until, now)
        if self.kind == PAUSE:
            self.kind, self.busy_until = IDLE, None
            self.epoch += 1
        return self.kick(now)

    def kick(self, now: float) -> list[tuple[str, Request]]:
        """React to a change: start work if idle, end a decode stretch at its next iteration."""
        out: list[tuple[str, Request]] = []
        if self.role is Role.DECODE:
            self._reserve_decode(out)
        if self.kind == IDLE:
            self._start_next(now, out)
        elif self.kind == DECODE and now < self.busy_until:
            done = self.timing.decode_iters_by(self.batch, self.ctx_sum, now - self.t0)
            k = min(done + 1, self.k_planned)
            if k < self.k_planned:
                self.k_planned = k
                self.busy_until = self.t0 + self.timing.decode_time(self.batch, self.ctx_sum, k)
                self.epoch += 1
        return out

    # -- the iteration boundary ------------------------------------------------------------------

    def wake(self, now: float) -> list[tuple[str, Request]]:
        """The work in flight ends at `now`: apply it, then start the next."""
        out: list[tuple[str, Request]] = []
        if self.kind == DECODE:
            self._advance_decode(self.k_planned, now - self.t0, out)
        elif self.kind == PREFILL:
            self._finish_prefill(now, out)
        self.kind, self.busy_until = IDLE, None
        if self.role is Role.DECODE:
            self._reserve_decode(out)
        self._start_next(now, out)
        return out

    def interrupt(self, now: float) -> tuple[list[Request], list[tuple[str, Request]]]:
        """Abort everything (the worker is going away): (aborted requests, turns that just finished).

        Decoding sequences keep the tokens of the iterations completed by `now` (the trajectory's
        partial progress); the iteration in flight is lost. The KV and the prefix cache are gone.
        """
        out: list[tuple[str, Request]] = []
        if self.kind == DECODE:
            k = self.k_planned if now >= self.busy_until else min(
                self.timing.decode_iters_by(self.batch, self.ctx_sum, now - self.t0), self.k_planned)
            self._advance_decode(k, self.timing.decode_time(self.batch, self.ctx_sum, k), out)
        aborted: list[Request] = []
        for _, _, req in self.heap:
            req.traj.turn_generated += self.counter - req.join_counter
            aborted.append(req)
        aborted += self.joining + self.prefilling + list(self.waiting)
        aborted += list(self.awaiting.values()) + list(self.inbound.values())
        for req in aborted:
            req.state = ABORTED
            if req.engine is self:
                req.kv = 0
            if req.prefill_engine is self:
                req.kv_prefill = 0
        self.waiting.clear()
        self.prefilling, self.joining, self.heap, self.plan = [], [], [], []
        self.awaiting.clear()
        self.inbound.clear()
        self.batch, self.ctx_sum = 0, 0.0
        self.kv = KVCache(self.kv.capacity)
        self.kind, self.busy_until = IDLE, None
        self.epoch += 1
        aborted.sort(key=lambda r: r.seq)
        return aborted, out

    # -- internals -------------------------------------------------------------------------------

    def _advance_decode(self, k: int, seconds: float, out: list[tuple[str, Request]]) -> None:
        if k <= 0:
            return
        if self.sink is not None:
            self.sink.append((self.worker, self.role, self.batch, self.ctx_sum / self.batch + (k - 1) / 2, 0,
                              seconds / k))
        self.decode_s += seconds
        self.decode_tokens += self.batch * k
        self.counter += k
        self.ctx_sum += self.batch * k
        self.kv.reserved += self.batch * k  # every sequence's KV grew by k tokens
        self.ratio = max(MIN_NEW_TOKEN_RATIO, self.ratio - k * NEW_TOKEN_RATIO_DECAY)
        heap = self.heap
        while heap and heap[0][0] <= self.counter:
            _, _, req = heapq.heappop(heap)
            self.batch -= 1
            self.ctx_sum -= req.context + req.gen
            req.traj.turn_generated += req.gen
            req.state = FINISHED
            self.kv.free(req.kv + req.gen)
            req.kv = 0
            if self.role is Role.COLOCATED and self.prefix_cache:
                self.kv.store(req.traj.id, req.context + req.gen)
            out.append(("done", req))
        if not heap:
            self.ctx_sum = 0.0  # no drift from float sums

    def _retract(self, out: list[tuple[str, Request]]) -> None:
        """Out of KV: retract the sequences with the fewest generated tokens (SGLang's order)."""
        running = sorted((r for _, _, r in self.heap),
                         key=lambda r: (self.counter - r.join_counter, -r.context, r.seq))
        victims = 0
        while len(running) - victims > 1 and \
                self.kv.capacity - self.kv.reserved < RETRACT_DECODE_STEPS * (len(running) - victims):
            req = running[victims]
            victims += 1
            done = self.counter - req.join_counter
            self.batch -= 1
            self.ctx_sum -= req.context + done
            self.kv.free(req.kv + done)
            req.kv = 0
            req.traj.turn_generated += done
            self.retractions += 1
            if self.role is Role.DECODE:
                req.state = ABORTED
                out.append(("retracted", req))
                continue
            if self.prefix_cache:
                self.kv.store(req.traj.id, req.context)
            req.context += done
            req.gen -= done
            req.max_new -= done
            req.cached = req.prefilled = 0
            req.state = WAITING
            self.waiting.append(req)
        kept = running[victims:]
        self.heap = [(r.join_counter + r.gen, r.seq, r) for r in kept]
        heapq.heapify(self.heap)
        decoded = sum(self.counter - r.join_counter for r in kept)
        budget = sum(r.max_new for r in kept)
        if budget:
            self.ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / budget)

    def _finish_prefill(self, now: float, out: list[tuple[str, Request]]) -> None:
        tokens = sum(n for _, n in self.plan)
        self.prefill_tokens += tokens
        self.prefill_s += now - self.t0
        if self.sink is not None:
            # the running decodes paused for this iteration: it decoded nothing (batch 0); its context
            # is what the new tokens attend to before them, token-weighted (t_p is linear in it)
            before = sum(n * req.prefilled for req, n in self.plan) / tokens
            self.sink.append((self.worker, self.role, 0, before, tokens, now - self.t0))
        for req, n in self.plan:
            req.prefilled += n
            if req.prefilled < req.context:
                continue
            self.prefilling.remove(req)
            if req.traj.turn == 0 and self.prefix_cache:
                self.kv.store(group_key(req.traj.group), req.traj.prompt)
            if self.role is Role.PREFILL:
                req.state = PREFILLED
                self.awaiting[req.seq] = req
                out.append(("prefilled", req))
            else:
                self._enter_batch(req)
        self.plan = []

    def _enter_batch(self, req: Request) -> None:
        req.state = DECODING
        req.join_counter = self.counter
        heapq.heappush(self.heap, (self.counter + req.gen, req.seq, req))
        self.batch += 1
        self.ctx_sum += req.context

    def _reserve_decode(self, out: list[tuple[str, Request]]) -> None:
        while self.waiting:
            req = self.waiting[0]
            if req.state == ABORTED:  # its prefill worker went away; the cancel here is on its way
                self.waiting.popleft()
                continue
            held = self.batch + len(self.inbound) + len(self.joining) + 1
            if not self.kv.reserve(req.context, extra=DECODE_RESERVED_TOKENS * held):
                return
            self.waiting.popleft()
            req.kv = req.context
            req.state = TRANSFERRING
            self.inbound[req.seq] = req
            out.append(("reserved", req))

    def _expected_growth(self) -> float:
        """Tokens the admitted sequences are expected to add: SGLang's admission estimate."""
        total = sum(min(r.max_new - (self.counter - r.join_counter), CLIP_MAX_NEW_TOKENS) for _, _, r in self.heap)
        total += sum(min(r.max_new, CLIP_MAX_NEW_TOKENS) for r in self.prefilling)
        return self.ratio * total

    def _admit_prefill(self, req: Request, growth: float) -> bool:
        cached = 0
        if self.prefix_cache:
            prompt = req.traj.prompt
            own = self.kv.hit(req.traj.id)
            reused = perfmodel.reusable_prefix(own, prompt, perfmodel.TURN_PREFIX_REUSE)  # docs/fidelity.md
            cached = max(int(reused), self.kv.hit(group_key(req.traj.group)))
        own = req.traj.id if req.traj.id in self.kv.cached else None
        extra = 0 if self.role is Role.PREFILL else int(growth + self.ratio * min(req.max_new, CLIP_MAX_NEW_TOKENS))
        if not self.kv.reserve(req.context, take=own, extra=extra):
            return False
        if self.role is Role.PREFILL:
            req.kv_prefill = req.context
        else:
            req.kv = req.context
        req.cached = req.prefilled = min(cached, req.context - 1)  # the last token is always computed
        req.state = PREFILLING
        return True

    def _prefill_plan(self) -> list[tuple[Request, int]]:
        budget = self.timing.chunk
        plan = []
        for req in self.prefilling:
            n = min(budget, req.context - req.prefilled)
            plan.append((req, n))
            budget -= n
            if budget == 0:
                return plan
        growth = self._expected_growth() if self.waiting and self.role is Role.COLOCATED else 0.0
        while budget > 0 and self.waiting and self._admit_prefill(self.waiting[0], growth):
            req = self.waiting.popleft()
            growth += self.ratio * min(req.max_new, CLIP_MAX_NEW_TOKENS)
            self.prefilling.append(req)
            n = min(budget, req.context - req.prefilled)
            plan.append((req, n))
            budget -= n
        return plan

    def _start_next(self, now: float, out: list[tuple[str, Request]]) -> None:
        if self.joining:
            for req in self.joining:
                self._enter_batch(req)
            self.joining = []
        if now < self.paused_until:
            self.kind, self.busy_until, self.t0 = PAUSE, self.paused_until, now
            self.epoch += 1
            return
        if self.role is not Role.DECODE:
            plan = self._prefill_plan()
            if plan:
                self.plan = plan
                t = self.timing.prefill_iteration([(n, req.prefilled) for req, n in plan])
                self.kind, self.t0, self.busy_until = PREFILL, now, now + t
                self.epoch += 1
                return
        if self.batch and self.kv.capacity - self.kv.reserved < self.batch:
            self._retract(out)
        if self.batch:
            room = (self.kv.capacity - self.kv.reserved) // self.batch  # iterations before the KV is full
            k = max(1, min(self.heap[0][0] - self.counter, room))
            self.kv.make_room(self.batch * k)
            self.kind, self.t0, self.k_planned = DECODE, now, k
            self.busy_until = now + self.timing.decode_time(self.batch, self.ctx_sum, k)
            self.epoch += 1
            return
        self.kind, self.busy_until = IDLE, None
