"""One worker's engine: closed-form decode, chunked prefill pausing decode, KV admission and
retraction, the prefix cache, interruption keeping partial progress, and the split path."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pearl.controlplane.core import perfmodel
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.sim.engine import ABORTED, FINISHED, PREFILLED, Engine, EngineTiming, Request
from pearl.sim.trajectories import Trajectory

pytestmark = pytest.mark.unit

PERF = PerfModel(default_catalog().model("qwen3-8b"), default_catalog().gpu("h800"), 2)
TIMING = EngineTiming(PERF)


def _traj(tid: int, prompt: int, gen: list[int], obs: list[int] | None = None, group: int | None = None) -> Trajectory:
    obs = obs if obs is not None else [0] * (len(gen) - 1)
    return Trajectory(tid, 0, tid if group is None else group, prompt, gen, obs, [1.0] * len(obs), False)


def _engine(role: Role = Role.COLOCATED, capacity: int | None = None, **kw) -> Engine:
    return Engine(0, role, TIMING, capacity or PERF.kv_capacity_tokens, sink=[], **kw)


def _run(engine: Engine, until: float = math.inf) -> list[tuple[float, str, Request]]:
    events = []
    while engine.busy_until is not None and engine.busy_until <= until:
        now = engine.busy_until
        events += [(now, what, req) for what, req in engine.wake(now)]
    return events


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 256), st.integers(0, 2_000_000), st.integers(1, 400))
def test_closed_form_decode_matches_iteration_by_iteration(batch, ctx, k):
    stepped = sum(PERF.iteration_time(decode_batch=batch, decode_context_tokens=ctx + i * batch) for i in range(k))
    closed = TIMING.decode_time(batch, ctx, k)
    assert closed == pytest.approx(stepped, rel=1e-9)
    assert TIMING.decode_iters_by(batch, ctx, closed) == k
    assert TIMING.decode_iters_by(batch, ctx, closed * (1 - 1e-9)) == k - 1


def test_one_request_prefills_then_decodes_in_the_model_time():
    engine = _engine()
    traj = _traj(0, 3000, [100])
    engine.submit(Request(traj, 1), 0.0)
    (end, what, req), = _run(engine)
    expected = TIMING.prefill_iteration([(3000, 0)]) + sum(PERF.decode_step_time(1, 3000 + i) for i in range(100))
    assert what == "done" and req.state == FINISHED
    assert end == pytest.approx(expected, rel=1e-9)
    assert (engine.prefill_tokens, engine.decode_tokens, traj.turn_generated) == (3000, 100, 100)
    assert engine.kv.reserved == 0 and engine.kv.hit(0) == 3100  # its context stays cached


def test_a_long_prompt_is_chunked():
    engine = _engine()
    engine.submit(Request(_traj(0, 20_000, [1]), 1), 0.0)
    _run(engine)
    prefill = [r for r in engine.sink if r[4] > 0]
    assert [r[4] for r in prefill] == [8192, 8192, 20_000 - 2 * 8192]


def test_an_arrival_pauses_decode_at_the_next_iteration_boundary():
    engine = _engine()
    engine.submit(Request(_traj(0, 1000, [2000]), 1), 0.0)
    _run(engine, until=TIMING.prefill_iteration([(1000, 0)]))  # prefilled; a long decode stretch starts
    t0, planned_end = engine.t0, engine.busy_until
    arrival = t0 + 0.5
    engine.submit(Request(_traj(1, 4000, [10]), 2), arrival)
    assert engine.busy_until < planned_end  # the stretch now ends at the first boundary after the arrival
    k = TIMING.decode_iters_by(1, 1000, arrival - t0) + 1
    assert engine.busy_until == pytest.approx(t0 + TIMING.decode_time(1, 1000, k))
    _run(engine, until=engine.busy_until)
    assert engine.kind == 1 and engine.plan[0][0].traj.id == 1  # a prefill iteration, decode paused
    assert engine.decode_tokens == k
    events = _run(engine)
    assert sorted(r.traj.id for _, what, r in events if what == "done") == [0, 1]
    assert engine.decode_tokens == 2010


def test_the_next_turn_prefills_only_what_is_new_where_its_prefix_lives(monkeypatch):
    """With its whole context reusable (TURN_PREFIX_REUSE 1) a turn prefills only the new observation;
    at the frozen value (0: the chat template drops earlier reasoning) only the prompt is reused;
    without a prefix cache everything is prefilled again."""
    for cache, reuse, expected in ((True, 1.0, 3000 + 500), (True, 0.0, 3000 + 600), (False, 1.0, 3000 + 3600)):
        monkeypatch.setattr(perfmodel, "TURN_PREFIX_REUSE", reuse)
        engine = _engine(prefix_cache=cache)
        traj = _traj(0, 3000, [100, 50], [500])
        engine.submit(Request(traj, 1), 0.0)
        now = _run(engine)[-1][0]
        traj.context += traj.gen[0] + traj.obs[0]
        traj.turn, traj.turn_generated = 1, 0
        engine.submit(Request(traj, 2), now + 1.0)
        _run(engine)
        assert engine.prefill_tokens == expected


def test_group_members_reuse_the_cached_prompt():
    engine = _engine()
    engine.submit(Request(_traj(0, 3000, [10], group=7), 1), 0.0)
    now = _run(engine)[-1][0]
    engine.submit(Request(_traj(1, 3000, [10], group=7), 2), now)
    _run(engine)
    assert engine.prefill_tokens == 3000 + 1  # the last prompt token is always computed


def test_admission_waits_while_the_kv_is_full():
    engine = _engine(capacity=5000)
    engine.submit(Request(_traj(0, 3000, [200]), 1), 0.0)
    engine.submit(Request(_traj(1, 3000, [200]), 2), 0.0)
    events = _run(engine)
    first, second = [t for t, what, _ in events if what == "done"]
    prefills = [r for r in engine.sink if r[4] > 0]
    assert [r[4] for r in prefills] == [3000, 3000]  # one at a time: both would not fit together
    assert second - first > TIMING.prefill_iteration([(3000, 0)])
    assert engine.kv.reserved == 0


def test_out_of_kv_retracts_and_loses_no_token():
    # both admitted on the optimistic estimate; their growth does not fit: one is retracted
    engine = _engine(capacity=4300)
    a, b = _traj(0, 1000, [1500]), _traj(1, 1000, [1500])
    engine.submit(Request(a, 1), 0.0)
    engine.submit(Request(b, 2), 0.0)
    events = _run(engine)
    assert engine.retractions >= 1
    assert sorted(r.traj.id for _, what, r in events if what == "done") == [0, 1]
    assert a.turn_generated == b.turn_generated == 1500
    assert engine.decode_tokens == 3000
    assert engine.kv.reserved == 0


def test_interrupt_keeps_the_tokens_of_completed_iterations():
    engine = _engine()
    traj = _traj(0, 2000, [1000])
    engine.submit(Request(traj, 1), 0.0)
    _run(engine, until=TIMING.prefill_iteration([(2000, 0)]))
    aborted, done = engine.interrupt(engine.t0 + 1.0)
    assert done == [] and [r.traj.id for r in aborted] == [0] and aborted[0].state == ABORTED
    assert 0 < traj.turn_generated < 1000
    assert traj.turn_generated == engine.decode_tokens == TIMING.decode_iters_by(1, 2000, 1.0)
    assert engine.idle and engine.kv.used == 0 and engine.busy_until is None
    # the rest of the turn, resubmitted, starts from the context plus what it generated
    rest = Request(traj, 2)
    assert (rest.context, rest.gen) == (2000 + traj.turn_generated, 1000 - traj.turn_generated)


def test_weight_sync_pause_delays_the_next_iteration():
    engine = _engine()
    engine.submit(Request(_traj(0, 1000, [50]), 1), 0.0)
    engine.pause(0.0, 5.0)  # the prefill iteration in flight completes; nothing else runs before 5 s
    (end, _, _), = _run(engine)
    assert end == pytest.approx(5.0 + sum(PERF.decode_step_time(1, 1000 + i) for i in range(50)), rel=1e-9)


def test_split_path_prefill_transfer_decode():
    pe, de = _engine(Role.PREFILL), Engine(1, Role.DECODE, TIMING, PERF.kv_capacity_tokens, sink=[])
    traj = _traj(0, 3000, [100])
    req = Request(traj, 1)
    pe.submit(req, 0.0)
    (t, what, r), = _run(pe)
    assert what == "prefilled" and r.state == PREFILLED and pe.kv.reserved == 3000
    assert de.submit(req, t) == [("reserved", req)]
    assert pe.transferred(req, t + 0.01) == []
    assert pe.kv.reserved == 0 and pe.kv.hit(0) == 3000  # the prefill worker keeps the prefix
    de.join(req, t + 0.01)
    (end, what, r), = _run(de)
    assert what == "done" and traj.turn_generated == 100 and de.kv.reserved == 0
    assert de.kv.hit(0) == 0  # the decode worker keeps nothing across turns
    assert de.prefill_tokens == 0


def test_cancel_frees_what_the_other_side_held():
    pe, de = _engine(Role.PREFILL), Engine(1, Role.DECODE, TIMING, PERF.kv_capacity_tokens, sink=[])
    req = Request(_traj(0, 3000, [100]), 1)
    pe.submit(req, 0.0)
    (t, _, _), = _run(pe)
    de.submit(req, t)
    aborted, _ = de.interrupt(t)
    assert aborted == [req]
    pe.cancel(req, t)
    assert pe.kv.reserved == 0 and pe.idle and de.idle


def test_a_decode_worker_out_of_kv_sends_a_sequence_back_with_its_progress():
    de = Engine(1, Role.DECODE, TIMING, 3100, sink=[])
    a, b = _traj(0, 1000, [1500]), _traj(1, 1000, [1500])
    reqs = [Request(a, 1), Request(b, 2)]
    for req in reqs:
        assert de.submit(req, 0.0) == [("reserved", req)]  # the context plus 512 tokens per sequence fit
        de.join(req, 0.0)
    events = _run(de)
    retracted = [r for _, what, r in events if what == "retracted"]
    done = [r for _, what, r in events if what == "done"]
    assert len(retracted) == 1 and len(done) == 1 and de.retractions == 1
    back = retracted[0]
    assert back.state == ABORTED and 0 < back.traj.turn_generated < 1500
    assert done[0].traj.turn_generated == 1500
    assert de.decode_tokens == 1500 + back.traj.turn_generated
    assert de.kv.reserved == 0


def test_a_request_aborted_on_its_prefill_worker_is_never_reserved_by_a_decode_worker():
    pe, de = _engine(Role.PREFILL), Engine(1, Role.DECODE, TIMING, 4000, sink=[])
    a, b = Request(_traj(0, 3000, [100]), 1), Request(_traj(1, 3000, [100]), 2)
    pe.submit(a, 0.0)
    pe.submit(b, 0.0)
    t = max(t for t, _, _ in _run(pe))
    assert de.submit(a, t) == [("reserved", a)]
    assert de.submit(b, t) == []  # no room yet: b waits for a's KV to leave
    aborted, _ = pe.interrupt(t)  # the prefill worker goes away with both
    assert {r.seq for r in aborted} == {1, 2}
    assert de.cancel(a, t) == []  # frees room, but b is aborted: not reserved
    assert 2 not in de.inbound and b.state == ABORTED
    de.cancel(b, t)
    assert de.idle and de.kv.reserved == 0
