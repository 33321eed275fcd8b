"""One worker's KV cache: tokens reserved by admitted requests plus a prefix cache, evicted LRU.

Running requests are never evicted; a request is admitted only when its reservation fits once every
cached prefix is evicted, so admission waits (head of line) while the KV is full. A cached prefix is
keyed by trajectory (its context after its last turn on this worker) or by GRPO group (the prompt its
members share). Shared prompt tokens are reserved again by every running member: a conservative
count (at most the prompt per trajectory) that keeps admission simple.
"""

from __future__ import annotations

from collections import OrderedDict


def group_key(group: int) -> int:
    """Cache key of a GRPO group's shared prompt (trajectory keys are their ids, >= 0)."""
    return -group - 1


class KVCache:
    """Reservations and an LRU prefix cache within `capacity` tokens."""

    __slots__ = ("capacity", "reserved", "cached", "cached_tokens")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reserved = 0  # tokens held by admitted requests (never evicted)
        self.cached: OrderedDict[int, int] = OrderedDict()  # key -> tokens, least recently used first
        self.cached_tokens = 0

    def hit(self, key: int) -> int:
        """Tokens cached under `key` (0 if none); marks the entry recently used."""
        tokens = self.cached.get(key)
        if tokens is None:
            return 0
        self.cached.move_to_end(key)
        return tokens

    def fits(self, tokens: int) -> bool:
        """Whether a reservation of `tokens` fits once every cached prefix is evicted."""
        return self.reserved + tokens <= self.capacity

    def reserve(self, tokens: int, take: int | None = None, extra: int = 0) -> bool:
        """Reserve `tokens` if `tokens + extra` fit (extra: room the running sequences need), first
        taking entry `take` out of the cache (it becomes the request's own)."""
        if not self.fits(tokens + extra):
            return False
        if take is not None:
            self.drop(take)
        self.make_room(tokens)
        self.reserved += tokens
        return True

    def free(self, tokens: int) -> None:
        self.reserved -= tokens

    def store(self, key: int, tokens: int) -> None:
        """Cache a prefix (replacing any older entry under the key); dropped if it cannot fit."""
        self.drop(key)
        if tokens <= 0 or not self.fits(tokens):
            return
        self.make_room(tokens)
        self.cached[key] = tokens
        self.cached_tokens += tokens

    def drop(self, key: int) -> None:
        tokens = self.cached.pop(key, None)
        if tokens is not None:
            self.cached_tokens -= tokens

    @property
    def used(self) -> int:
        return self.reserved + self.cached_tokens

    def make_room(self, tokens: int) -> None:
        """Evict cached prefixes, least recently used first, until `tokens` more fit (if they can)."""
        while self.reserved + self.cached_tokens + tokens > self.capacity and self.cached:
            _, evicted = self.cached.popitem(last=False)
            self.cached_tokens -= evicted
