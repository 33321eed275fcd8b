"""The weight-sync worker's watch on its own consumer (agents/celery_app.py): work waiting in the
node's queue while a thread stays free for `stall_s` in a row restarts the worker in place."""

from __future__ import annotations

from pearl.agents.celery_app import Resender


def watcher(restarts: list[float], stall_s: float = 10.0) -> Resender:
    return Resender(app=None, broker_url="redis://unused", node="node-a", interval_s=2.0, concurrency=2,
                    stall_s=stall_s, restart=lambda: restarts.append(1.0))


def test_work_waiting_with_a_free_thread_for_stall_s_restarts_the_worker_once_the_time_is_up() -> None:
    restarts: list[float] = []
    w = watcher(restarts)
    for now in (100.0, 104.0, 109.9):
        w.watch(depth=3, running=1, now=now)
    assert restarts == []
    w.watch(depth=3, running=1, now=110.0)
    assert restarts == [1.0]


def test_an_empty_queue_or_every_thread_busy_is_no_stall_and_starts_the_count_over() -> None:
    restarts: list[float] = []
    w = watcher(restarts)
    w.watch(depth=3, running=0, now=0.0)
    w.watch(depth=0, running=0, now=8.0)  # the consumer took it: the count starts over
    w.watch(depth=3, running=0, now=9.0)
    w.watch(depth=3, running=2, now=15.0)  # every thread busy: the queue waits for them, rightly
    w.watch(depth=3, running=0, now=16.0)
    w.watch(depth=3, running=0, now=25.0)
    assert restarts == [] and w.stalled_since == 16.0
    w.watch(depth=3, running=0, now=26.0)
    assert restarts == [1.0]


def test_a_worker_being_stopped_is_not_restarted() -> None:
    restarts: list[float] = []
    w = watcher(restarts, stall_s=1.0)
    w.stopped.set()
    w.watch(depth=1, running=0, now=0.0)
    w.watch(depth=1, running=0, now=5.0)
    assert restarts == []
