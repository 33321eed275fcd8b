"""How turns are routed across the workers that serve, shared by the simulator's router and the
live front door's routers.

A trajectory's next turn goes back to the worker that holds its prefix (it prefills only what is
new) unless that worker is much busier than the least loaded one: at least `REBALANCE_MIN_EXTRA`
more live trajectories (requests, for SGLang's router) and `REBALANCE_RATIO` times as many. Then
the turn moves to the least loaded worker and prefills its whole context there. This is how newly
admitted workers (a borrow, a preemptible grant) take their share of a batch already in flight;
SGLang's router defaults (64 more) suit a chat service, not a rollout batch of tens of
trajectories.
"""

from pearl.controlplane.core.domain import Role

WORKER_TYPE = {Role.COLOCATED: "regular", Role.PREFILL: "prefill", Role.DECODE: "decode"}  # sglang-router's names

REBALANCE_MIN_EXTRA = 2  # live trajectories more than the least loaded worker, at least
REBALANCE_RATIO = 1.5  # and this many times as many
