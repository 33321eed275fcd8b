"""Prefix-sticky routing of turns to admitted workers, shared by every system.

A trajectory's next turn goes back to the worker that holds its prefix (colocated worker, or prefill
worker when split) while that worker is admitted, so it prefills only what is new; otherwise, or when
the holder is much busier than the least loaded worker, to the least loaded one, where it prefills
its whole context. Moving costs a re-prefill, so it happens only when the holder carries at least
`REBALANCE_MIN_EXTRA` more live trajectories and `REBALANCE_RATIO` times as many as the least loaded
worker (`controlplane/core/routing.py`): this is how newly admitted workers take their share of a
batch already in flight (the cache-aware routing of SGLang's router, with thresholds scaled to a
rollout batch). A split fleet's
decode worker is the least loaded at each turn (the decode side keeps no prefix across turns).
"""

from __future__ import annotations

from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.routing import REBALANCE_MIN_EXTRA, REBALANCE_RATIO

from .engine import Engine
from .trajectories import Trajectory


class Router:
    """Which admitted worker serves each turn; counts the live trajectories each holds."""

    def __init__(self) -> None:
        self.engines: dict[int, Engine] = {}  # admitted workers by id
        self.owned: dict[Engine, int] = {}  # live trajectories whose prefix each admitted engine holds
        self.pending: list[Trajectory] = []  # turns waiting for any admitted worker, in order

    def admit(self, engine: Engine) -> None:
        self.engines[engine.worker] = engine
        self.owned.setdefault(engine, 0)

    def remove(self, worker: int) -> None:
        """Stop dispatching to `worker` (drain); the trajectories it holds move on their next turn."""
        engine = self.engines.pop(worker, None)
        if engine is not None:
            del self.owned[engine]

    def routable(self, role: Role) -> list[Engine]:
        return [e for e in self.engines.values() if e.role is role]

    def can_serve(self) -> bool:
        roles = {e.role for e in self.engines.values()}
        return Role.COLOCATED in roles or (Role.PREFILL in roles and Role.DECODE in roles)

    def front(self, traj: Trajectory) -> Engine:
        """The worker that prefills the turn (colocated or prefill); it becomes the prefix holder."""
        roles = {e.role for e in self.engines.values()}
        role = Role.COLOCATED if Role.COLOCATED in roles else Role.PREFILL
        owned = self.owned
        least = min((e for e in self.engines.values() if e.role is role),
                    key=lambda e: (owned[e], e.load, e.worker))
        holder = traj.holder
        if holder in owned and holder.role is role:
            mine, low = owned[holder], owned[least]
            if mine - low < REBALANCE_MIN_EXTRA or mine < REBALANCE_RATIO * low:
                return holder
        self._move(traj, least)
        return least

    def decode(self) -> Engine:
        return min((e for e in self.engines.values() if e.role is Role.DECODE), key=lambda e: (e.load, e.worker))

    def finished(self, traj: Trajectory) -> None:
        """The trajectory is done: it no longer counts towards its holder's load."""
        self._move(traj, None)

    def _move(self, traj: Trajectory, engine: Engine | None) -> None:
        old = traj.holder
        if old in self.owned:
            self.owned[old] -= 1
        traj.holder = engine
        if engine is not None:
            self.owned[engine] += 1
