"""The trajectories of one rollout step: sampled from the scenario's Workload, then played turn by turn.

Deterministic in (seed, rollout step): the same batch whatever the system, so systems are compared
on the same work. A GRPO group's members share their prompt (same length, same cached prefix). A
trajectory whose context reaches `max_context_tokens` ends there, truncated, and counts.

Turn i: the request prefills what the serving worker lacks of the context, decodes `gen[i]` tokens,
then the environment runs for `env_s[i]` and appends `obs[i]` tokens before turn i+1. The last turn
has no environment step, so `obs` and `env_s` have one entry fewer than `gen`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pearl.controlplane.core.telemetry import TrajectoryRecord
from pearl.controlplane.core.workload import Workload

if TYPE_CHECKING:  # numpy is imported where a batch is sampled: the simulated server never samples one
    import numpy as np


class Trajectory:
    """One trajectory's plan (sampled) and progress (mutated by the simulator)."""

    __slots__ = (
        "id", "step", "group", "prompt", "gen", "obs", "env_s", "truncated",
        "turn", "turn_generated", "context", "holder", "done",
    )

    def __init__(self, tid: int, step: int, group: int, prompt: int, gen: list[int], obs: list[int],
                 env_s: list[float], truncated: bool) -> None:
        self.id = tid  # unique over the run: step * batch_size + index
        self.step = step  # the rollout step (batch) it belongs to
        self.group = group  # GRPO group, unique over the run
        self.prompt = prompt
        self.gen = gen  # tokens to generate per turn (after truncation)
        self.obs = obs  # tokens the environment appends after each turn but the last
        self.env_s = env_s  # environment time after each turn but the last
        self.truncated = truncated
        self.turn = 0  # the turn in progress (or waiting for its environment)
        self.turn_generated = 0  # tokens of the current turn generated so far, kept across interruptions
        self.context = prompt  # tokens in the context before the current turn's generation
        self.holder: object | None = None  # the engine (colocated or prefill) holding its prefix, for routing
        self.done = False

    @property
    def turns(self) -> int:
        return len(self.gen)

    @property
    def generated_tokens(self) -> int:
        return sum(self.gen)

    @property
    def total_tokens(self) -> int:
        """Prompt, observations and generated tokens: what the trained batch contains."""
        return self.prompt + sum(self.obs) + sum(self.gen)

    @property
    def metric_tokens(self) -> int:
        """The metric's count for this trajectory (docs/method.md): generated tokens plus all tokens."""
        return self.generated_tokens + self.total_tokens

    def record(self) -> TrajectoryRecord:
        return TrajectoryRecord(turns=self.turns, prompt_tokens=self.prompt, obs_tokens=list(self.obs),
                                gen_tokens=list(self.gen), env_s=list(self.env_s), truncated=self.truncated)


def _whole(x: np.ndarray, low: int) -> np.ndarray:
    import numpy as np

    return np.maximum(np.rint(x), low).astype(np.int64)


def sample_batch(workload: Workload, seed: int, step: int) -> list[Trajectory]:
    """The `workload.batch_size` trajectories of rollout step `step`; a pure function of (seed, step)."""
    import numpy as np

    rng = np.random.default_rng([seed, step])
    b, g, cap = workload.batch_size, workload.group_size, workload.max_context_tokens
    turns = _whole(workload.turns.sample(rng, b), 1)
    prompts = np.repeat(_whole(workload.prompt_tokens.sample(rng, b // g), 1), g)
    width = int(turns.max())
    gen = _whole(workload.gen_tokens_per_turn.sample(rng, b * width), 1).reshape(b, width)
    obs = _whole(workload.obs_tokens_per_turn.sample(rng, b * width), 0).reshape(b, width)
    env = np.maximum(workload.env_latency_s.sample(rng, b * width), 0.0).reshape(b, width)
    out = []
    for i in range(b):
        prompt = min(int(prompts[i]), cap - 1)  # at least one token of room to generate
        context, gens, obss, envs, truncated = prompt, [], [], [], False
        n = int(turns[i])
        for k in range(n):
            room = cap - context
            produced = min(int(gen[i, k]), room)
            gens.append(produced)
            context += produced
            if context >= cap:
                truncated = True
                break
            if k == n - 1:
                break
            appended = int(obs[i, k])
            if context + appended >= cap:  # no room left for another turn: it ends here
                truncated = True
                break
            obss.append(appended)
            envs.append(float(env[i, k]))
            context += appended
        out.append(Trajectory(step * b + i, step, step * (b // g) + i // g, prompt, gens, obss, envs, truncated))
    return out
