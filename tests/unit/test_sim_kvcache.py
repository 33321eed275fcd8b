"""A worker's KV: reservations are never evicted, cached prefixes go least recently used first."""

from __future__ import annotations

import pytest
from pearl.sim.kvcache import KVCache, group_key

pytestmark = pytest.mark.unit


def test_reservation_evicts_cached_prefixes_lru_first():
    kv = KVCache(100)
    kv.store(1, 30)
    kv.store(2, 30)
    kv.store(3, 30)
    assert kv.hit(1) == 30  # 1 is now the most recently used
    assert kv.reserve(40)
    assert list(kv.cached) == [3, 1]  # 2 was the least recently used
    assert kv.used <= kv.capacity


def test_running_reservations_are_never_evicted():
    kv = KVCache(100)
    assert kv.reserve(70)
    kv.store(5, 20)
    assert not kv.reserve(40)  # only 30 could ever be freed
    assert kv.reserved == 70 and kv.hit(5) == 20
    kv.free(70)
    assert kv.reserve(90)
    assert kv.hit(5) == 0  # evicted to make room


def test_taking_its_own_prefix_and_the_extra_room_check():
    kv = KVCache(100)
    kv.store(7, 60)
    assert not kv.reserve(50, extra=60)  # 50 + 60 > 100 even with everything evicted
    assert kv.reserve(70, take=7)
    assert 7 not in kv.cached and kv.reserved == 70


def test_a_prefix_that_cannot_fit_is_dropped_and_group_keys_do_not_collide():
    kv = KVCache(100)
    kv.reserve(90)
    kv.store(1, 20)
    assert kv.hit(1) == 0
    assert group_key(0) < 0 and group_key(0) != group_key(1)
