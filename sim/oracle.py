"""`oracle`: an upper bound with hindsight and free reconfiguration, its own simulator run.

For each rollout step the oracle pauses the run as the step begins (its batch becomes the one under
way: the previous batch is complete and this one exists), copies it once per candidate (colocated,
or split with N_P prefill workers; each with or without borrowing the idle training GPUs), puts the
candidate's fleet in place (at no cost, so at once: turns on a worker that goes are resubmitted with
their progress), plays every copy to the end of that step, and continues from the copy that ended it
first. Step 0 is chosen the same way at t=0, before its batch starts, so the fleet that serves it
is the chosen candidate's.
It never reads other systems' results.

- Free reconfiguration: every reconfiguration cost is zero for it (cold start, admission, role
  switch, borrow and return, the weight load of a new server), and a role flip does not wait for
  the server to finish its requests (they move on at once, each keeping its progress). The weight
  sync after each training step still pauses every server: that is the workload, paid by every
  system alike.
- Hindsight: a candidate is judged by simulating the step to its end, preemptions and grants of
  the trace included (the oracle knows the whole trace; with zero start costs a worker is ready the
  moment its GPUs are granted).
- Candidates (every mode and ratio, no pruning by a model): colocated, and every N_P from 1 to
  N - 1, where N is the dedicated workers at the step's beginning, plus the overlap workers for
  the borrowing variants. During the step the split keeps its N_P prefill workers and the decode
  pool absorbs budget changes (N_P is capped at N - 1). Candidates are tried in the order that
  usually wins (colocated with borrowing first, then without, then the splits by N_P); each copy
  stops as soon as it runs past the best end found so far (it cannot win), which is what keeps the
  search within the time budget. Ties go to the earlier candidate.

Greedy per step (the best end of each step in turn, not the best schedule of the whole run): the
result is an upper bound in practice, which `sim compare` checks (`checks.oracle_upper_bound`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

from pearl.controlplane.core.fleet import FleetSnapshot, Target
from pearl.policies.base import Signals, colocated, split
from pearl.policies.borrowing import borrowable
from pearl.policies.elasticity import dedicated_capacity

from .metrics import Result
from .runner import Simulation
from .scenario import Reconfig, Scenario

FREE = Reconfig(cold_start_s=0.0, admit_s=0.0, role_switch_s=0.0, toggle_on_s=0.0, toggle_off_s=0.0)


@dataclass(frozen=True)
class Choice:
    """One candidate for a rollout step: the shape and whether to borrow."""

    n_prefill: int = 0  # 0: colocated; else split with this many prefill workers (capped at N - 1)
    borrow: bool = False

    @property
    def label(self) -> str:
        shape = f"{self.n_prefill}P" if self.n_prefill else "colocated"
        return shape + ("+borrow" if self.borrow else "")


@dataclass(frozen=True)
class OraclePolicy:
    """Plays the Choice in its memory (set by the oracle between steps) on whatever is available."""

    name: str = "oracle"

    def initial_memory(self) -> Choice:
        return Choice()

    def decide(self, snapshot: FleetSnapshot, signals: Signals, memory: Choice) -> tuple[Target, Choice]:
        members = [w.id for w in dedicated_capacity(snapshot)]
        if memory.borrow:
            members += [w.id for w in borrowable(snapshot, signals)]
        n = len(members)
        if memory.n_prefill and n >= 2:
            p = min(memory.n_prefill, n - 1)
            return split(members, p, f"oracle: {p}P{n - p}D ({memory.label})"), memory
        return colocated(members, f"oracle: colocated x{n} ({memory.label})"), memory


class _Playable(Simulation):
    """A run whose reconfigurations are free, that halts when a rollout step begins (until `play` picks
    its fleet) and, with `stop_after`, when that step ends."""

    def __init__(self, scenario: Scenario, progress: Callable[[float], None] | None = None) -> None:
        super().__init__(scenario, OraclePolicy(), progress)
        self.executor.cost = FREE
        self.executor.weight_sync_s = 0.0  # a new server's weight load; the post-training sync stays
        self.executor.drain_wait = False  # a flip does not wait for the server's requests to finish
        self.stop_after: int | None = None  # halt when this rollout step ends
        self.held_back = False  # a rollout step has begun; its fleet waits for `play`
        self.chosen_for = -1  # the step whose fleet `play` put in place last

    def _rollout_end(self) -> None:
        step = self.begun
        super()._rollout_end()
        if step == self.stop_after:
            self.halted = True

    def _create_batches(self) -> None:
        if self.trainer.created == 0 and self.chosen_for < 0:  # step 0: its fleet first, then its batch
            self.held_back = self.halted = True
            return
        super()._create_batches()

    def _rollout_begin(self) -> None:
        if self.begun != self.chosen_for:
            self.held_back = self.halted = True

    @property
    def step_held(self) -> int:
        """The step whose fleet waits for `play`."""
        return self.begun if self.trainer.created else 0

    def play(self, choice: Choice) -> None:
        """Put `choice`'s fleet in place (free reconfiguration takes no time) for the step under way."""
        self.memory = choice
        self.decide_pending.append("oracle")
        self._decide()
        self.held_back = self.halted = False
        self.chosen_for = self.step_held
        if self.trainer.created == 0:
            self._create_batches()


def candidates(sim: Simulation) -> list[Choice]:
    """Every shape and borrowing choice for the step that just began (module docstring)."""
    snapshot = sim.cluster.snapshot(sim.version, True)
    dedicated = len(dedicated_capacity(snapshot))
    overlap = len(sim.cluster.overlap)
    out = ([Choice(0, True)] if overlap else []) + [Choice(0, False)]
    for borrow in (True, False) if overlap else (False,):
        n = dedicated + (overlap if borrow else 0)
        out += [Choice(p, borrow) for p in range(1, n)]
    return out


def _fork(sim: _Playable) -> _Playable:
    """A copy of the paused run sharing what never changes (scenario, perf model, policy)."""
    shared = {id(x): x for x in (sim.sc, sim.perf, sim.policy, sim.executor.cost, *sim.timings.values())}
    shared[id(sim.progress)] = None
    return copy.deepcopy(sim, shared)


def _best_step(sim: _Playable) -> tuple[_Playable, int]:
    """Play the step that just began once per candidate; the copy that ended it first (and how many ran)."""
    step, duration = sim.step_held, sim.sc.duration_s
    best: _Playable | None = None
    best_key: tuple[int, float] = (2, 0.0)
    tried = 0
    for choice in candidates(sim):
        fork = _fork(sim)
        fork.stop_after = step
        fork.play(choice)
        limit = min(duration, best.now) if best is not None and best_key[0] == 0 else duration
        fork.advance(limit)
        tried += 1
        # ended the step: by its end time; else (the run ends first) by the tokens generated so far
        key = (0, fork.now) if fork.halted else (1, -float(fork.turn_tokens))
        if key < best_key:
            best, best_key = fork, key
    assert best is not None
    best.stop_after = None
    best.halted = False
    best.progress = sim.progress
    return best, tried


def search(scenario: Scenario, progress: Callable[[float], None] | None = None) -> Simulation:
    """The oracle's run, played step by step to `duration_s` (module docstring); not yet finished."""
    sim = _Playable(scenario, progress)
    sim.begin()  # halts as step 0 begins
    while sim.now < sim.sc.duration_s:
        if sim.held_back:
            sim, _ = _best_step(sim)
            if progress is not None:  # the forks report nothing; the chosen one has reached here
                progress(sim.now)
            continue
        sim.advance(sim.sc.duration_s)  # the trainer holds the next step back: play on until it begins
        if not sim.halted:
            break
    return sim


def run_oracle(scenario: Scenario, progress: Callable[[float], None] | None = None) -> Result:
    """The oracle's result on `scenario`."""
    wall = time.perf_counter()
    sim = search(scenario, progress)
    return sim.finish(time.perf_counter() - wall)
