"""The calibration set (the paper's §3, docs/fidelity.md): each figure as the simulator gives it.

- Fig. 2a: Qwen3-8B, colocated (RLBoost+ without preemptible GPUs is a static colocated fleet),
  8 training GPUs at TRAINING_STEP_8_GPUS_S, 16 / 24 / 32 rollout GPUs as TP2 workers: the mean
  rollout-step makespan, its fall from 16 to 24 and 24 to 32 (relative to 16), rollout over training
  time, the mean trajectory duration, and rollout's share of the end-to-end time at 32 GPUs.
- Fig. 2b: Qwen3-30B-A3B, colocated, prefix cache on: prefill's share of the tokens the engines
  process and of their busy time (the Fig. 2c colocated fleet at batch 64).
- Fig. 2c: Qwen3-30B-A3B, 16 GPUs as 8 TP2 workers: colocated against every split 1P7D..7P1D at
  batch 32 / 48 / 64 / 80 / 96: the best split's gain over colocation and the best ratio.

Every run is a static fleet measured over `steps` rollout steps after one warm-up step (the
warm-up starts on fresh engines), on the shipped paper workload (sim/scenarios/ablation-*).
`before()` evaluates the same figures with the engine and workload as they were before the fit.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from pearl.controlplane.core import perfmodel
from pearl.controlplane.core.predictor import Config

from . import scenario as scenario_module
from .ratio import _Recorded, static_policy, with_workers
from .scenario import load_scenario

BASE = "ablation-qwen3-8b-dedicated16"
TRAINING_STEP_8_GPUS_S = 163.8  # the paper's measured step on 8 training GPUs (Fig. 2a)
MOE_SCENARIO = ["model=qwen3-30b-a3b"]
FIG2A_GPUS = (16, 24, 32)
FIG2A_STEPS = 6  # the makespan is the slowest trajectory's: more steps than elsewhere to average its tail
FIG2C_BATCHES = (32, 48, 64, 80, 96)
FIG2C_WORKERS = 8
WARMUP = 1

# The paper's figures (arXiv 2609.35158, §3)
PAPER = {
    "fig2a": {"makespan_s": {16: 934.0, 24: 838.0, 32: 755.0}, "fall_16_24": 0.103, "fall_24_32": 0.089,
              "rollout_over_training": (4.5, 5.7), "trajectory_mean_s": 216.3, "rollout_share_32": 0.818},
    "fig2b": {"prefill_token_share": 0.9668, "prefill_time_share": 0.2648},
    "fig2c": {"split_gain": {32: 0.097, 80: 0.014, 96: -0.061}, "best_ratio": {48: "4P4D", 64: "5P3D"}},
}
# The engine and workload before the fit (for the before/after report)
BEFORE_WORKLOAD = ["workload.gen_tokens_per_turn.median=900", "workload.obs_tokens_per_turn.median=600",
                   "workload.env_latency_s.p99=30", "workload.turns.p99=50", "workload.turns.max=64"]
BEFORE_MOE_EXPERT_BW_EFFICIENCY = 0.25


@dataclass(frozen=True)
class StaticMeasure:
    makespan_s: float
    trajectory_mean_s: float
    prefill_token_share: float
    prefill_time_share: float


def measure(overrides: list[str], config: Config, steps: int = 3) -> StaticMeasure:
    sc = load_scenario(BASE, [*overrides, "duration_s=20000"])
    sim = _Recorded(with_workers(sc, config.workers), static_policy(config), WARMUP + steps)
    sim.begin()
    sim.advance(50 * sc.duration_s)
    engines = [w.engine for w in sim.workers.values() if w.engine is not None]
    pt, dt = sum(e.prefill_tokens for e in engines), sum(e.decode_tokens for e in engines)
    ps, ds = sum(e.prefill_s for e in engines), sum(e.decode_s for e in engines)
    chosen = sim.makespans[WARMUP:WARMUP + steps]
    return StaticMeasure(statistics.fmean(chosen), statistics.fmean(sim.trajectory_durations),
                         pt / (pt + dt) if pt + dt else 0.0, ps / (ps + ds) if ps + ds else 0.0)


def fig2a(extra: list[str] | None = None) -> dict:
    base = [*(extra or []), "cluster.training_gpus=8", f"training.step_s={TRAINING_STEP_8_GPUS_S}"]
    runs = {n: measure(base, Config(n_colocated=n // 2), FIG2A_STEPS) for n in FIG2A_GPUS}
    m = {n: r.makespan_s for n, r in runs.items()}
    return {
        "makespan_s": {n: round(v, 1) for n, v in m.items()},
        "fall_16_24": round((m[16] - m[24]) / m[16], 4),
        "fall_24_32": round((m[24] - m[32]) / m[16], 4),
        "rollout_over_training": (round(m[32] / TRAINING_STEP_8_GPUS_S, 2), round(m[16] / TRAINING_STEP_8_GPUS_S, 2)),
        "trajectory_mean_s": round(statistics.fmean(r.trajectory_mean_s for r in runs.values()), 1),
        "rollout_share_32": round(m[32] / (m[32] + TRAINING_STEP_8_GPUS_S), 4),
    }


def fig2c(extra: list[str] | None = None) -> tuple[dict, dict]:
    """(Fig. 2c, Fig. 2b): the split sweep, and the colocated fleet's prefill shares at batch 64."""
    gains, best, shares = {}, {}, {}
    for batch in FIG2C_BATCHES:
        over = [*(extra or []), *MOE_SCENARIO, f"workload.batch_size={batch}"]
        colo = measure(over, Config(n_colocated=FIG2C_WORKERS))
        splits = {p: measure(over, Config(n_prefill=p, n_decode=FIG2C_WORKERS - p)).makespan_s
                  for p in range(1, FIG2C_WORKERS)}
        p = min(splits, key=splits.get)
        gains[batch] = round(colo.makespan_s / splits[p] - 1, 4)
        best[batch] = f"{p}P{FIG2C_WORKERS - p}D"
        if batch == 64:
            shares = {"prefill_token_share": round(colo.prefill_token_share, 4),
                      "prefill_time_share": round(colo.prefill_time_share, 4)}
    return {"split_gain": gains, "best_ratio": best}, shares


def fig2b(extra: list[str] | None = None) -> dict:
    """Fig. 2b alone: the Fig. 2c colocated fleet at batch 64, prefill's shares of tokens and time."""
    colo = measure([*(extra or []), *MOE_SCENARIO, "workload.batch_size=64"], Config(n_colocated=FIG2C_WORKERS))
    return {"prefill_token_share": round(colo.prefill_token_share, 4),
            "prefill_time_share": round(colo.prefill_time_share, 4)}


def figures(extra: list[str] | None = None) -> dict:
    a = fig2a(extra)
    c, b = fig2c(extra)
    return {"fig2a": a, "fig2b": b, "fig2c": c}


@contextlib.contextmanager
def _engine_before() -> Iterator[None]:
    """The engine before the fit: kernel speed for decode and prefill, MoE experts at 0.25, each turn
    reusing its whole cached context."""
    saved = perfmodel.MOE_EXPERT_BW_EFFICIENCY, scenario_module.AGENTIC_LOAD, perfmodel.TURN_PREFIX_REUSE
    perfmodel.MOE_EXPERT_BW_EFFICIENCY = BEFORE_MOE_EXPERT_BW_EFFICIENCY
    scenario_module.AGENTIC_LOAD = perfmodel.KERNEL
    perfmodel.TURN_PREFIX_REUSE = 1.0
    try:
        yield
    finally:
        perfmodel.MOE_EXPERT_BW_EFFICIENCY, scenario_module.AGENTIC_LOAD, perfmodel.TURN_PREFIX_REUSE = saved


def before() -> dict:
    with _engine_before():
        return figures(BEFORE_WORKLOAD)


def deviation(paper: float, sim: float) -> float:
    """sim / paper - 1."""
    return sim / paper - 1
