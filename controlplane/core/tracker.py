"""The runtime tracker: fold one rollout step's telemetry into the profile (refit every step).

Pure: no I/O. `fit_profile(prior, telemetry)` returns the next profile; the database adapter stores
each result as a new `profiles` row (history kept, provenance `fitted`), the simulator keeps it in
the policy's memory.

What is refit, each with weight α = max(alpha_min, 1/(steps + 1)) for the new step (the first
step replaces the prior, later steps average, then an exponential window of ~1/alpha_min steps):
- workload pools: prompts, intended turns, tokens generated and appended per turn, environment
  time per turn, merged as weighted quantiles. A trajectory ended by the context cap only says
  its intended turns were at least those it ran, and its last generation (cut at the cap) or the
  observation that no longer fitted were at least what the cap left: those are censored values,
  so turns and tokens are estimated by Kaplan-Meier (ignoring them, or taking them at face value,
  biases tokens per turn low and the predicted makespan high); the mass beyond the last
  uncensored value follows the previous pool's tail;
- f, the measured share of live trajectories decoding, when reported;
- the engine, when `iterations` are reported: per batch bin, the median ratio of measured to
  predicted decode iteration time scales the decode curve; the median ratio for prefill tokens
  scales t_p (geometric EMA of the ratios, so one odd step cannot swing it);
- T_over, when the step's makespan and configuration are known (per-batch barrier): the per-turn
  residual between the observed makespan and the prediction (T_over = 0) for that very batch of
  trajectories, an EMA kept signed (`overhead_residual_s`) so that noise averages out; T_over is
  its positive part;
- the mode's correction, when the step's makespan and configuration are known (asynchronous
  batches): log(observed / predicted) for that batch's trajectories, its mean and mean square as
  EMAs per mode (`Profile.mode_corrections`); the predictor multiplies the model's step times in a
  mode that ran by the shrunk correction (`Profile.mode_adjustment`), a mode that never ran keeps
  the model alone.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.predictor import Config, predict_batch
from pearl.controlplane.core.profile import (
    DECODE_BATCHES,
    EngineProfile,
    Profile,
    ProfileKey,
    Provenance,
    TrajectorySample,
    WorkloadPools,
    level_masses,
    quantile_pool,
)
from pearl.controlplane.core.telemetry import IterationRecord, StepTelemetry, TrajectoryRecord
from pearl.controlplane.errors import BadInput

# The refit forgets with a window of about twenty steps: the slowest of B trajectories is decided by
# environment waits of one draw in 10^3-10^4, which a shorter window estimates poorly (on the paper
# workload a ten-step window moved the predicted makespan by +-8% from step to step).
ALPHA_MIN = 0.05
MIN_POINTS = 3  # iterations needed in a batch bin before its ratio is trusted


def fit_profile(
    prior: Profile,
    telemetry: StepTelemetry,
    *,
    makespan_s: float | None = None,
    config: Config | None = None,
    device: str | None = None,
    alpha_min: float = ALPHA_MIN,
) -> Profile:
    """The profile after one more step of telemetry (module docstring). `device` re-keys the result
    (a measurement on one device never overrides the profile of another)."""
    if not 0 < alpha_min <= 1:
        raise BadInput(f"alpha_min: must be in (0, 1], got {alpha_min}")
    if makespan_s is not None and (not math.isfinite(makespan_s) or makespan_s <= 0):
        raise BadInput(f"makespan_s: must be a finite number > 0, got {makespan_s}")
    alpha = max(alpha_min, 1.0 / (prior.steps_observed + 1))
    trajectories = [t for t in telemetry.trajectories if t.turns > 0]
    if not trajectories:
        raise BadInput("telemetry.trajectories: no trajectory ran a turn")
    pools = _merge_pools(prior.workload, trajectories, alpha, prior.max_context_tokens)
    engine, engine_fit = _fit_engine(prior.engine, telemetry.iterations, alpha)
    f = prior.decode_fraction
    if telemetry.decode_fraction is not None:
        f = (1 - alpha) * f + alpha * telemetry.decode_fraction
    key = prior.key if device is None else ProfileKey(prior.key.model, prior.key.gpu, prior.key.tp, device)
    fitted = replace(
        prior,
        key=key,
        provenance=Provenance.FITTED,
        batch_size=telemetry.batch_size,
        engine=engine,
        workload=pools,
        decode_fraction=f,
        steps_observed=prior.steps_observed + 1,
        fit={},
    )
    fit: dict[str, Any] = {"step": telemetry.step, "alpha": alpha, "trajectories": len(trajectories), **engine_fit}
    if makespan_s is not None and config is not None and prior.rollout.is_async:
        # asynchronous batches: the step is the interval between batches, whose spread no per-turn
        # term explains; the measured over predicted ratio for this batch's trajectories is folded
        # into the mode's correction instead (Profile.mode_adjustment)
        batch = trajectory_sample(trajectories)
        base = predict_batch(replace(fitted, t_over_s=0.0, mode_corrections=()), config, batch)
        observed = math.log(makespan_s / base.makespan_s)
        mode = config.mode.value
        n, m, q = prior.mode_correction(mode)
        a = max(alpha_min, 1.0 / (n + 1))
        entry = (mode, n + 1, (1 - a) * m + a * observed, (1 - a) * q + a * observed**2)
        corrections = tuple(sorted([c for c in prior.mode_corrections if c[0] != mode] + [entry]))
        fit.update(makespan_s=makespan_s, predicted_s=base.makespan_s, config=config.label, log_ratio=observed)
        fitted = replace(fitted, mode_corrections=corrections)
    elif makespan_s is not None and config is not None:
        # Compare with the prediction for this very batch (not the expectation over batches): the
        # residual is then the model's error, not the luck of the draw.
        batch = trajectory_sample(trajectories)
        base = predict_batch(replace(fitted, t_over_s=0.0), config, batch)
        turns = float(np.max(batch.turns))
        observed = (makespan_s - base.makespan_s) / turns
        residual = (1 - alpha) * prior.overhead_residual_s + alpha * observed
        fit.update(
            makespan_s=makespan_s, predicted_s=base.makespan_s, config=config.label, residual_per_turn_s=observed
        )
        fitted = replace(fitted, t_over_s=max(0.0, residual), overhead_residual_s=residual)
    return replace(fitted, fit=fit)


# -- workload -------------------------------------------------------------------------------------


def trajectory_sample(trajectories: list[TrajectoryRecord]) -> TrajectorySample:
    """A step's measured trajectories as the predictor's sample (one row each)."""
    k, r = len(trajectories), max(t.turns for t in trajectories)
    gen, obs, env = np.zeros((k, r)), np.zeros((k, r)), np.zeros((k, r))
    for j, t in enumerate(trajectories):
        n = t.turns
        gen[j, :n] = t.gen_tokens
        follow = min(n - 1, len(t.obs_tokens))  # what the environment appended before a next turn
        obs[j, :follow] = t.obs_tokens[:follow]
        waits = min(n - 1, len(t.env_s))
        env[j, :waits] = t.env_s[:waits]
    return TrajectorySample(
        prompt=np.array([t.prompt_tokens for t in trajectories], dtype=float),
        gen=gen,
        obs=obs,
        env=env,
        turns=np.array([t.turns for t in trajectories]),
        truncated=np.array([t.truncated for t in trajectories]),
    )


def _merge(
    old: tuple[float, ...], levels: np.ndarray, values: np.ndarray, probs: np.ndarray, alpha: float
) -> tuple[float, ...]:
    """Quantiles at `levels` of the old pool (weight 1 - α in all) and the new distribution (α)."""
    if len(values) == 0:
        return old
    if alpha >= 1:
        return quantile_pool(values, levels, probs)
    merged = np.concatenate([old, values])
    weights = np.concatenate([(1 - alpha) * level_masses(levels), alpha * probs / probs.sum()])
    return quantile_pool(merged, levels, weights)


def censored_distribution(
    values: Any, censored: Any, tail: tuple[float, ...] = (), tail_mass: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier distribution of `values` where `censored` ones are only lower bounds: (values, probabilities).

    Past the last uncensored value the data say nothing more, so each value censored there hands
    its share to the previous pool `tail` (weights `tail_mass`, equal by default) above its own
    bound (redistribute-to-the-right onto the previous belief); to its bound when `tail` has nothing there.
    """
    v = np.asarray(values, dtype=float)
    cut = np.asarray(censored, dtype=bool)
    events, counts = np.unique(v[~cut], return_counts=True)
    at_risk = len(v) - np.searchsorted(np.sort(v), events, side="left")  # values >= each event
    hazard = counts / at_risk
    survival = np.concatenate([[1.0], np.cumprod(1 - hazard)])
    out_v, out_p = list(events), list(survival[:-1] * hazard)
    rest = v[cut & (v > events[-1])] if len(events) else v
    if len(rest):
        share = float(survival[-1]) / len(rest)
        pool = np.asarray(tail, dtype=float)
        mass = np.ones(len(pool)) if tail_mass is None else np.asarray(tail_mass, dtype=float)
        for bound, n in zip(*np.unique(rest, return_counts=True), strict=True):
            above = pool >= bound
            if above.any() and mass[above].sum() > 0:
                out_v.extend(pool[above].tolist())
                out_p.extend((share * n * mass[above] / mass[above].sum()).tolist())
            else:
                out_v.append(float(bound))
                out_p.append(share * n)
    return np.asarray(out_v), np.asarray(out_p)


def _merge_pools(old: WorkloadPools, trajectories: list[TrajectoryRecord], alpha: float, cap: int) -> WorkloadPools:
    """The pools after one step. A trajectory ended by the context cap censors three values: its
    intended turns (at least those it ran), and either its last generation (cut at the cap) or the
    observation that no longer fitted (at least the room left, when the record does not carry it)."""
    gen: list[tuple[float, bool]] = []
    obs: list[tuple[float, bool]] = []
    env: list[float] = []
    for t in trajectories:
        n = t.turns
        before_next = list(t.obs_tokens[: n - 1])
        context = t.prompt_tokens + sum(t.gen_tokens) + sum(before_next)
        gen_cut = t.truncated and context >= cap
        gen.extend((float(x), gen_cut and i == n - 1) for i, x in enumerate(t.gen_tokens))
        obs.extend((float(x), False) for x in t.obs_tokens)
        if t.truncated and not gen_cut and len(t.obs_tokens) < n:
            obs.append((float(cap - context), True))
        env.extend(t.env_s)
    levels = old.cdf_levels(len(old.turns))
    masses = level_masses(levels)

    def fold(pool: tuple[float, ...], pairs: list[tuple[float, bool]]) -> tuple[float, ...]:
        if not pairs:
            return pool
        values, probs = censored_distribution([x for x, _ in pairs], [c for _, c in pairs], pool, masses)
        return _merge(pool, levels, values, probs, alpha)

    def plain(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(values, dtype=float), np.ones(len(values))

    turns = [(float(t.turns), t.truncated) for t in trajectories]
    return WorkloadPools(
        prompt_tokens=_merge(old.prompt_tokens, levels, *plain([t.prompt_tokens for t in trajectories]), alpha),
        turns=fold(old.turns, turns),
        gen_tokens=fold(old.gen_tokens, gen),
        obs_tokens=fold(old.obs_tokens, obs),
        env_s=_merge(old.env_s, levels, *plain(env), alpha),
        levels=old.levels,
    )


# -- engine ---------------------------------------------------------------------------------------


def _fit_engine(
    engine: EngineProfile, iterations: list[IterationRecord], alpha: float
) -> tuple[EngineProfile, dict[str, Any]]:
    """Scale the decode curve per batch bin and t_p by the median measured/predicted ratios."""
    if not iterations:
        return engine, {}
    decode = [i for i in iterations if i.prefill_tokens == 0 and i.batch > 0 and i.role is not Role.PREFILL]
    prefill = [i for i in iterations if i.prefill_tokens > 0]
    fit: dict[str, Any] = {"decode_points": len(decode), "prefill_points": len(prefill)}
    base = list(engine.decode_base_s)
    ratios_all: list[float] = []
    if decode:
        batch = np.array([i.batch for i in decode], dtype=float)
        ratio = np.array([i.seconds for i in decode]) / engine.decode_iteration_s(
            batch, np.array([i.context_tokens_mean for i in decode])
        )
        bins = np.abs(np.log(batch)[:, None] - np.log(np.array(DECODE_BATCHES, dtype=float))[None, :]).argmin(axis=1)
        for b_i in range(len(engine.decode_batches)):
            inside = ratio[bins == b_i]
            if len(inside) >= MIN_POINTS:
                base[b_i] *= float(np.median(inside)) ** alpha
                ratios_all.extend(inside.tolist())
    b_ctx = engine.decode_s_per_ctx_token
    if len(ratios_all) >= MIN_POINTS:
        median = float(np.median(ratios_all))
        b_ctx *= median**alpha
        fit["decode_ratio"] = median
    t_p0, t_pc = engine.prefill_s_per_token, engine.prefill_s_per_token_per_ctx
    if len(prefill) >= MIN_POINTS:
        own = np.array([engine.decode_iteration_s(i.batch, i.context_tokens_mean) if i.batch else 0.0 for i in prefill])
        tokens = np.array([i.prefill_tokens for i in prefill], dtype=float)
        ctx = np.array([i.context_tokens_mean for i in prefill])
        measured = (np.array([i.seconds for i in prefill]) - own) / tokens
        ratio = measured / engine.prefill_s_per_token_at(ctx)
        ratio = ratio[ratio > 0]
        if len(ratio) >= MIN_POINTS:
            median = float(np.median(ratio))
            t_p0 *= median**alpha
            t_pc *= median**alpha
            fit["prefill_ratio"] = median
    fitted = replace(
        engine,
        decode_base_s=tuple(base),
        decode_s_per_ctx_token=b_ctx,
        prefill_s_per_token=t_p0,
        prefill_s_per_token_per_ctx=t_pc,
    )
    return fitted, fit
