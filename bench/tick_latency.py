"""Tick latency and the return of borrowed GPUs: the policy loop against a real PostgreSQL.

Prints one JSON object with two parts.

`tick`: one policy pass (`policies.live.tick.tick`: reap, observe and decide, write the decision and
the plan, apply it) on a fleet that needs a plan: the paper's cluster (sim/inventories/
paper-32-h800.yaml, with the paper scenario's workload block) at 32 GPUs, and its nodes repeated to
512 and 4096 GPUs, just imported, nothing serving. Each repetition starts from a fresh copy of the
imported fleet (a database cloned from it), after one pass that warms the process up. Reported:
p50/p99 of the pass, its parts (reap, decide, write, apply), the plan's steps, and the baseline
measured in the same run: the pure decision on the same inputs (`PearlPolicy.decide` and
`orchestrate`, no database), with the ratio pass / pure decision.

`return`: from a training-begin event to the last borrowed GPU back, with 4 and 16 overlap workers
borrowed (training nodes of 8 GPUs at TP2, beside a rollout node of 4 GPUs). Node agents
(agents/agent.py, one per node, in threads over in-process fake servers: tests/agent_support.py) and
the policy loop (`policies.live.loop.PolicyLoop`, in a thread: it wakes on the event and ticks) run
with their default timings. Each repetition: the fleet serves with every overlap worker borrowed;
`ControlPlane.training_begin` (the trainer's call) records the request and waits; the loop plans the
return, the agents drain, interrupt and release; the training step starts with the last return.
Reported, p50/p99 over the repetitions: the database's own figure (the step's `started_at` -
`requested_at`), the trainer's wait in `training_begin`, and beside them what the release steps
themselves took (claim to report, from the rows): their sum, and the longest worker's chain
(drain + interrupt + release: the critical path), with `protocol_s` = return - critical path, what
the loop's wake-up, the pass, the claims and the hand-offs between steps add. Then
`ControlPlane.training_end`, and the loop lends the GPUs again before the next repetition.

    .venv/bin/python bench/tick_latency.py [--quick] [--database-url URL] [--repeat 7]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import yaml
from db_support import REPO, BenchServer, machine, ms
from pearl.controlplane.api import ControlPlane
from pearl.controlplane.core.domain import Activity, PlanStatus, StepAction, WorkerZone
from pearl.controlplane.core.inventory import parse_inventory
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.store import plan_store, reaper
from pearl.controlplane.store.db import make_engine, transaction
from pearl.controlplane.store.inventory_import import import_inventory
from pearl.controlplane.store.schema import Node, Plan, PlanStep, TrainingStep, Worker
from pearl.policies.live import policy_pass
from pearl.policies.live.loop import LoopConfig, PolicyLoop
from pearl.policies.live.tick import tick
from sqlalchemy import Engine, func, select, text

sys.path.insert(0, str(REPO / "tests"))
from agent_support import FakeDriver, FakeFrontDoor, FakeServers  # noqa: E402  (tests/agent_support.py)
from pearl.agents.agent import Agent, AgentConfig  # noqa: E402

PAPER_INVENTORY = REPO / "sim" / "inventories" / "paper-32-h800.yaml"
PAPER_SCENARIO = REPO / "sim" / "scenarios" / "paper-qwen3-8b-seg2.yaml"


def workload() -> dict[str, Any]:
    return yaml.safe_load(PAPER_SCENARIO.read_text())["workload"]


def paper_inventory(gpus: int) -> dict[str, Any]:
    """The paper's cluster with its nodes repeated to `gpus` GPUs (a multiple of 32)."""
    raw = yaml.safe_load(PAPER_INVENTORY.read_text())
    copies = gpus // sum(n["gpus"] for n in raw["nodes"])
    nodes = [{**n, "name": f"{n['name']}-{k}" if copies > 1 else n["name"]}
             for k in range(copies) for n in raw["nodes"]]
    return {**raw, "nodes": nodes, "workload": workload()}


def import_fleet(engine: Engine, raw: dict[str, Any]) -> None:
    with transaction(engine, actor="bench") as session:
        import_inventory(session, parse_inventory(raw))


# -- one pass --------------------------------------------------------------------------------------


class PhaseTimer:
    """Wall time of the parts of a pass: the module functions `tick` calls, wrapped while timing."""

    PARTS = {"reap": (reaper, "reap"), "decide": (policy_pass, "decide"),
             "write": (policy_pass, "write_planned"), "apply": (plan_store, "apply")}

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.planned: policy_pass.Planned | None = None

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        originals = {name: getattr(module, attr) for name, (module, attr) in self.PARTS.items()}

        def wrap(name: str, fn):
            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    result = fn(*args, **kwargs)
                finally:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                if name == "decide":
                    self.planned = result
                return result
            return timed

        for name, (module, attr) in self.PARTS.items():
            setattr(module, attr, wrap(name, originals[name]))
        try:
            yield
        finally:
            for name, (module, attr) in self.PARTS.items():
                setattr(module, attr, originals[name])


def pure_decision(planned: policy_pass.Planned, repeat: int = 3) -> float:
    """The decision the pass made, on the same snapshot, signals and profile, with no database: the
    median of `repeat` runs of PearlPolicy.decide + orchestrate (from the policy's initial memory)."""
    times = []
    for _ in range(repeat):
        policy = policy_pass.live_policy(planned.profile)  # a fresh policy: no assessment to reuse
        memory = policy.initial_memory()
        t0 = time.perf_counter()
        target, _ = policy.decide(planned.snapshot, planned.signals, memory)
        orchestrate(planned.snapshot, target)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tick_latency(server: BenchServer, gpus: int, repeat: int) -> dict[str, Any]:
    template = server.pearl_database("bench_tick_fleet")
    engine = make_engine(template)
    import_fleet(engine, paper_inventory(gpus))
    engine.dispose()
    passes, pure, steps = [], [], []
    parts: dict[str, list[float]] = {name: [] for name in PhaseTimer.PARTS}
    notes = set()
    try:
        for r in range(repeat + 1):  # the first pass warms the process up (imports, caches)
            url = server.clone(template, "bench_tick")
            engine = make_engine(url)
            try:
                with engine.connect() as conn:
                    conn.execute(text("SELECT 1"))  # the pool's connection, as a running loop has it
                timer = PhaseTimer()
                with timer.timing():
                    t0 = time.perf_counter()
                    result = tick(engine, holder="bench")
                    took = time.perf_counter() - t0
                if not (result.ran and result.plan is not None and result.applied):
                    raise RuntimeError(f"{gpus} GPUs: the pass planned nothing: {result.note}")
                if r == 0:
                    continue
                passes.append(took)
                for name in parts:
                    parts[name].append(timer.seconds.get(name, 0.0))
                assert timer.planned is not None
                pure.append(pure_decision(timer.planned))
                steps.append(len(timer.planned.plan.steps))
                notes.add(result.note.split(" (")[0].replace(f"plan {result.plan} ", "plan "))
            finally:
                engine.dispose()
                server.drop(url)
    finally:
        server.drop(template)
    p50, base = statistics.median(passes), statistics.median(pure)
    return {
        "gpus": gpus,
        "workers": gpus // 2,
        "plan_steps": statistics.median(steps),
        "outcome": sorted(notes),
        "pass": ms(passes),
        "parts_p50_ms": {name: round(statistics.median(xs) * 1e3, 3) for name, xs in parts.items()},
        "baseline_pure_decision": ms(pure),
        "ratio_pass_to_pure_decision": round(p50 / base, 1) if base > 0 else None,
    }


# -- the return of borrowed GPUs -------------------------------------------------------------------


class LiveFleet:
    """Agents (one per node) and the policy loop, in threads of this process, over fake servers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.servers = FakeServers()
        self.front_door = FakeFrontDoor()
        self.threads: list[threading.Thread] = []
        self.stoppers: list[Any] = []

    def start(self) -> None:
        with transaction(self.engine) as session:
            nodes = session.scalars(select(Node.name).order_by(Node.id)).all()
        for node in nodes:
            agent = Agent(self.engine, AgentConfig(node=node, driver="fake"), FakeDriver(self.servers, node),
                          client=self.servers.client, front_door=lambda: self.front_door)
            self._run(agent, f"agent-{node}")
        self._run(PolicyLoop(self.engine, LoopConfig(), holder="bench-loop"), "loop")

    def _run(self, runner: Any, name: str) -> None:
        thread = threading.Thread(target=runner.run, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)
        self.stoppers.append(runner)

    def stop(self) -> None:
        for runner in self.stoppers:
            runner.stop()
        for thread in self.threads:
            thread.join(timeout=60)


def _borrowed_and_settled(engine: Engine, overlap: int) -> bool:
    with transaction(engine) as session:
        active = session.scalar(select(func.count()).where(Worker.zone == WorkerZone.OVERLAP,
                                                           Worker.activity == Activity.ACTIVE))
        applying = session.scalar(select(func.count()).where(Plan.status == PlanStatus.APPLYING))
    return active == overlap and not applying


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.02)


def _release_steps(engine: Engine, step: int) -> tuple[float, float, int]:
    """The release steps (drain, interrupt, release) of the overlap workers in the plans applied for
    training step `step`: the sum of their own durations (claim to report), the longest worker's
    chain, and how many."""
    with transaction(engine) as session:
        row = session.get(TrainingStep, step)
        plans = select(Plan.id).where(Plan.applied_at >= row.requested_at, Plan.applied_at <= row.started_at)
        rows = session.execute(
            select(PlanStep.worker_id, PlanStep.started_at, PlanStep.finished_at)
            .join(Worker, Worker.id == PlanStep.worker_id)
            .where(PlanStep.plan_id.in_(plans), Worker.zone == WorkerZone.OVERLAP, PlanStep.status == "succeeded",
                   PlanStep.action.in_([StepAction.DRAIN, StepAction.INTERRUPT, StepAction.RELEASE]))).all()
    chains: dict[int, float] = {}
    for worker, began, ended in rows:
        chains[worker] = chains.get(worker, 0.0) + (ended - began).total_seconds()
    return sum(chains.values()), max(chains.values(), default=0.0), len(rows)


def borrowed_return(server: BenchServer, overlap: int, repeat: int) -> dict[str, Any]:
    training_nodes = overlap * 2 // 8
    raw = {"model": "qwen3-8b", "gpu": "h800", "tp": 2, "workload": workload(), "nodes": [
        *({"name": f"train-{i}", "zone": "training", "gpus": 8, "address": "127.0.0.1"}
          for i in range(training_nodes)),
        {"name": "roll-0", "zone": "rollout", "gpus": 4, "address": "127.0.0.1"}]}
    url = server.pearl_database("bench_return")
    engine = make_engine(url, pool_size=training_nodes * 4 + 16, max_overflow=16)
    import_fleet(engine, raw)
    cp = ControlPlane(engine=engine)
    fleet = LiveFleet(engine)
    fleet.start()
    returns, waits, sums, paths, protocol = [], [], [], [], []
    releases = 0
    try:
        for step in range(repeat + 1):  # the first cycle warms up (and measures the first borrow cycle)
            _wait(lambda: _borrowed_and_settled(engine, overlap), 120, f"{overlap} overlap workers borrowed")
            began = cp.training_begin(step, wait_s=120, poll_s=0.005)
            with transaction(engine) as session:
                row = session.get(TrainingStep, step)
                back = (row.started_at - row.requested_at).total_seconds()
            total, path, n = _release_steps(engine, step)
            cp.training_end(step)
            if step == 0:
                continue
            returns.append(back)
            waits.append(began.waited_s)
            sums.append(total)
            paths.append(path)
            protocol.append(back - path)
            releases = n
    finally:
        fleet.stop()
        engine.dispose()
        server.drop(url)
    return {
        "overlap_workers": overlap,
        "borrowed_gpus": overlap * 2,
        "release_steps": releases,
        "repetitions": len(returns),
        "return": ms(returns),
        "trainer_wait": ms(waits),
        "release_steps_sum": ms(sums),
        "critical_path": ms(paths),
        "protocol": ms(protocol),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version for a smoke test")
    parser.add_argument("--gpus", default=None, help="tick sizes, multiples of 32 (default 32,512,4096)")
    parser.add_argument("--overlap", default=None, help="borrowed overlap workers, multiples of 4 (default 4,16)")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--database-url", help="a maintenance database of the server to use (default: an "
                        "embedded server of the benchmark's own)")
    args = parser.parse_args()
    sizes = [int(g) for g in (args.gpus or ("32" if args.quick else "32,512,4096")).split(",")]
    overlaps = [int(w) for w in (args.overlap or ("4" if args.quick else "4,16")).split(",")]
    repeat = args.repeat or (2 if args.quick else 7)
    started = time.perf_counter()
    with BenchServer(args.database_url) as server:
        out: dict[str, Any] = {"bench": "tick_latency", "quick": args.quick, "repeat": repeat,
                               "database": server.settings(), "machine": machine()}
        out["tick"] = [tick_latency(server, g, repeat) for g in sizes]
        out["return"] = [borrowed_return(server, w, repeat) for w in overlaps]
    out["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
