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


def routing_drift(listed: set[tuple[str, Role]], serving: list[tuple[int, str, Role]]
                  ) -> tuple[list[tuple[int, str, Role]], list[str]]:
    """Where the routers and the rows disagree: the serving workers (id, endpoint, role) that no router
    lists under their role, and the URLs the routers list that no serving worker has."""
    missing = [w for w in serving if (w[1], w[2]) not in listed]
    endpoints = {endpoint for _, endpoint, _ in serving}
    unknown = sorted({url for url, _ in listed if url not in endpoints})
    return missing, unknown


REBALANCE_MIN_EXTRA = 2  # live trajectories more than the least loaded worker, at least
REBALANCE_RATIO = 1.5  # and this many times as many
