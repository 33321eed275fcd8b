"""The fitted profile: what the makespan predictor needs about the engine and the workload.

Pure: no I/O. A profile is keyed by (model, gpu, tp, device) and says where its figures come from
(`catalog`: the performance model's prior; `measured`: kernels timed on the device; `fitted`: refit
from rollout telemetry). The database stores it as JSONB (`profile_to_dict` / `profile_from_dict`),
one row per refit, so its history is kept.

Engine. A decode iteration of `n` sequences over a summed context of `n * ctx` tokens costs
  T_iter(n, ctx) = base(n) + b_ctx * n * ctx
exactly as in `PerfModel.iteration_time` (only attention reads the context); `base` is a table over
batch sizes (a line for dense models, strongly concave for MoE models), linearly interpolated.
Prefill costs t_p(ctx) = t_p0 + t_pc * ctx per new token after `ctx` cached tokens. A turn reuses
the prompt and `turn_prefix_reuse` of the rest of its cached context (`perfmodel.TURN_PREFIX_REUSE`,
as the simulated engine does); the rest it prefills again. The method's
A and b are the secant of T_iter around a batch hint at the mean decode context.

Workload. Quantile pools of the prompt, the intended turns, and the tokens generated, tokens
appended and environment time of a turn: the scenario distributions' quantiles for the prior, the
measured values for a fitted profile (`tracker`). The predictor times a large deterministic sample
of trajectories drawn from the pools with the context cap applied; the method's symbols are
statistics of that sample: S the expected turns of the slowest of B trajectories, ΔL the new
prompt tokens per turn, r the tokens generated per turn, T_env the environment time along the
slowest trajectory. Keeping distributions rather than means is what lets the predictor model the
long tail and the context cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from statistics import NormalDist
from typing import Any

import numpy as np
from pearl.controlplane.core import perfmodel
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import TURN_PREFIX_REUSE, PerfModel
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.errors import BadInput
from pydantic import TypeAdapter, ValidationError

_NORMAL = NormalDist()

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # where the decode base curve is tabulated
PREFILL_CHUNK_TOKENS = 2048  # t_p is measured on chunks of this size (the method's "per token")
POOL_SIZE = 512  # quantiles kept per workload quantity
DRAW_BLOCK = 8  # turns drawn at a time for the sample
TAIL_Z = 4.4  # the pools reach the quantiles at normal scores ±4.4 (probability 5e-6 beyond each end)
SAMPLE_SIZE = 2048  # synthetic trajectories the predictor times (expected max within ~1.3% over seeds)
SAMPLE_SEED = 20240917  # fixed: the sample is a deterministic function of the pools
BATCH_HINT_WORKERS = 8  # A and b are a secant around B/8 decoding sequences per worker
# The predictor's error in a mode it has not seen run (sd of log(measured / predicted) step time): the
# RMS error of the model alone against the simulator over the paper's Table 2 settings
# (bench/table2.py: 4.0% for colocation, 3.1% over the 49 feasible splits)
MODEL_ERROR = 0.04
STEP_NOISE_PRIOR = 0.15  # one step's spread around the expected step time (asynchronous batches, measured)
STEP_NOISE_MIN = 0.02  # the least spread credited to measured steps


class Provenance(StrEnum):
    CATALOG = "catalog"  # the performance model from the catalog (the prior)
    MEASURED = "measured"  # kernels timed on the device
    FITTED = "fitted"  # refit from rollout telemetry


@dataclass(frozen=True)
class ProfileKey:
    """A measurement on one device never overrides the profile of another."""

    model: str
    gpu: str
    tp: int
    device: str = "catalog"  # a device class or host; "catalog" for the prior


@dataclass(frozen=True)
class EngineProfile:
    """Timing of one worker (a TP group): decode and prefill iterations, KV transfer and capacity."""

    decode_batches: tuple[int, ...]
    decode_base_s: tuple[float, ...]  # decode iteration at each batch over zero context
    decode_s_per_ctx_token: float  # b_ctx: seconds per token of summed context per iteration
    prefill_s_per_token: float  # t_p0: per new token with nothing cached before it
    prefill_s_per_token_per_ctx: float  # t_pc: extra per new token per cached token before it
    kv_bytes_per_token: float  # K
    kv_bandwidth_bps: float  # BW: bytes/s a worker's NICs move between prefill and decode pools
    kv_setup_s: float  # per-transfer handshake
    kv_capacity_tokens: int  # KV tokens one worker holds
    turn_prefix_reuse: float = TURN_PREFIX_REUSE  # share of the context beyond the prompt the next turn reuses
    # a split's workers run at their own serving efficiencies: a decode-only worker's decode iteration
    # and a prefill-only worker's prefill, each relative to a colocated worker's (1.0: the same)
    decode_only_scale: float = 1.0
    prefill_only_scale: float = 1.0

    def decode_iteration_s(self, batch: Any, ctx_mean: Any) -> Any:
        """T_iter(n, ctx) = base(n) + b_ctx * n * ctx (numpy-broadcastable; base linear between points)."""
        base = np.interp(batch, self.decode_batches, self.decode_base_s)
        slope = (self.decode_base_s[-1] - self.decode_base_s[-2]) / (self.decode_batches[-1] - self.decode_batches[-2])
        base = base + np.maximum(np.asarray(batch, dtype=float) - self.decode_batches[-1], 0.0) * slope
        return base + self.decode_s_per_ctx_token * np.asarray(batch, dtype=float) * ctx_mean

    def prefill_s_per_token_at(self, ctx_before: Any) -> Any:
        """t_p(ctx) = t_p0 + t_pc * ctx."""
        return self.prefill_s_per_token + self.prefill_s_per_token_per_ctx * np.asarray(ctx_before, dtype=float)

    def kv_transfer_s(self, tokens: Any) -> Any:
        return self.kv_setup_s + np.asarray(tokens, dtype=float) * self.kv_bytes_per_token / self.kv_bandwidth_bps

    def a_b(self, ctx_mean: float, batch_hint: float) -> tuple[float, float]:
        """The method's (A, b): secant of T_iter between batch_hint/2 and 2*batch_hint at ctx_mean."""
        lo, hi = max(1.0, batch_hint / 2), max(2.0, batch_hint * 2)
        t_lo, t_hi = (float(self.decode_iteration_s(n, ctx_mean)) for n in (lo, hi))
        b = (t_hi - t_lo) / (hi - lo)
        a = t_lo - b * lo
        if a < 0:  # a convex curve (or noisy measurement): keep A >= 0 and match T_iter at the lower batch
            return 0.0, t_lo / lo
        return a, b


@dataclass(frozen=True)
class WorkloadPools:
    """The workload as quantile pools: one value per CDF level, one pool per quantity.

    Turns are the intended number of turns (before the context cap ends a trajectory); per-turn
    quantities are independent draws per turn. The prior's pools are the scenario distributions'
    quantiles (no sampling noise); fitted pools come from telemetry (`tracker`). The levels are
    spaced evenly in normal score up to ±TAIL_Z, so the far tail is kept: the slowest of 64
    trajectories is decided by environment waits of one draw in ten thousand.
    """

    prompt_tokens: tuple[float, ...]
    turns: tuple[float, ...]
    gen_tokens: tuple[float, ...]  # generated per turn
    obs_tokens: tuple[float, ...]  # appended by the environment after a turn
    env_s: tuple[float, ...]  # environment time after a turn that another turn follows
    levels: tuple[float, ...] = ()  # CDF level of each pool entry; () means (i + 1/2)/n

    def cdf_levels(self, n: int) -> np.ndarray:
        return np.asarray(self.levels) if self.levels else (np.arange(n) + 0.5) / n


def pool_levels(n: int = POOL_SIZE) -> tuple[float, ...]:
    """n CDF levels evenly spaced in normal score over [-TAIL_Z, TAIL_Z]."""
    return tuple(_NORMAL.cdf(float(z)) for z in np.linspace(-TAIL_Z, TAIL_Z, n))


def level_masses(levels: np.ndarray) -> np.ndarray:
    """Probability each pool entry stands for (between the midpoints to its neighbours)."""
    edges = np.concatenate([[0.0], (levels[1:] + levels[:-1]) / 2, [1.0]])
    return np.diff(edges)


@dataclass(frozen=True, eq=False)
class TrajectorySample:
    """K synthetic trajectories drawn from the pools, the context cap applied (matrices K x R)."""

    prompt: np.ndarray  # (K,)
    gen: np.ndarray  # tokens generated in turn k (0 where the turn does not exist)
    obs: np.ndarray  # tokens appended after turn k, before turn k+1 (0 after the last)
    env: np.ndarray  # environment time after turn k
    turns: np.ndarray  # (K,) turns that ran
    truncated: np.ndarray  # (K,) bool: ended by the context cap


def draw_trajectories(pools: WorkloadPools, cap: int, k: int, seed: int = SAMPLE_SEED) -> TrajectorySample:
    """K trajectories: a turn runs while the intended turns last and the context stays under `cap`;
    the turn that reaches the cap is cut there and is the last (as the simulator truncates)."""
    rng = np.random.default_rng(seed)

    def pick(pool: tuple[float, ...], shape: tuple[int, ...]) -> np.ndarray:
        """Inverse-CDF draws, linear between the pool's quantiles, stratified: each of the n draws
        falls in its own 1/n slice of probability in random order, so the sample holds exactly its
        share of the far tail (on the paper workload the expected maximum's spread over seeds drops
        from 3.6% to 1.3%)."""
        n = int(np.prod(shape))
        u = ((rng.permutation(n) + rng.random(n)) / n).reshape(shape)
        return np.interp(u, pools.cdf_levels(len(pool)), np.asarray(pool, dtype=float))

    intended = np.maximum(1, np.rint(pick(pools.turns, (k,)))).astype(int)
    prompt = np.clip(np.rint(pick(pools.prompt_tokens, (k,))), 1, cap - 1)
    # Turns are drawn in blocks until no trajectory can run further: the context cap usually ends
    # them long before the intended turns' maximum.
    blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    reached, drawn = prompt.copy(), 0
    while drawn < intended.max() and ((reached < cap) & (intended > drawn)).any():
        w = min(DRAW_BLOCK, int(intended.max()) - drawn)
        g = np.maximum(1, np.rint(pick(pools.gen_tokens, (k, w))))
        o = np.maximum(0, np.rint(pick(pools.obs_tokens, (k, w))))
        blocks.append((g, o, np.maximum(0.0, pick(pools.env_s, (k, w)))))
        reached = reached + (g + o).sum(axis=1)
        drawn += w
    gen, obs, env = (np.hstack(parts) for parts in zip(*blocks, strict=True))
    r = drawn
    start = prompt[:, None] + np.cumsum(gen + obs, axis=1) - gen - obs  # context when turn k starts
    runs = (np.arange(r)[None, :] < intended[:, None]) & (start < cap)
    # turn k+1 only starts if turn k's generation and observation left room
    runs[:, 1:] &= (start[:, 1:] < cap) & (start[:, :-1] + gen[:, :-1] + obs[:, :-1] < cap)
    runs = np.cumprod(runs, axis=1).astype(bool)
    turns = runs.sum(axis=1)
    gen = np.where(runs, np.minimum(gen, cap - start), 0.0)
    last = np.zeros_like(runs)
    last[np.arange(k), turns - 1] = True
    end = start + gen  # context after turn k's generation
    truncated = (turns < intended) | ((end >= cap) & last).any(axis=1)
    obs = np.where(runs & ~last, obs, 0.0)
    env = np.where(runs & ~last, env, 0.0)  # the last turn has no environment step after it
    r = int(turns.max())  # rounds no trajectory reaches are dropped
    return TrajectorySample(prompt, gen[:, :r], obs[:, :r], env[:, :r], turns, truncated)


@dataclass(frozen=True)
class Rollout:
    """How the RL framework forms its batches (a scenario's `training` block): what turns the
    trajectories' times into the interval between batches.

    `sync`: each batch starts whole once the previous one is complete (a per-batch barrier): a step
    lasts as long as its slowest trajectory. `async` (ROLL's asynchronous mode): `slots` environment
    slots each run `trajectories_per_slot` trajectories of a batch back to back and go on with the
    next batch at once, never more than `staleness` batches ahead of the weights; batch k + staleness
    + 1 exists `update_gap_s` after batch k completes (a training step and its weight update)."""

    batching: str = "sync"
    trajectories_per_slot: int = 1
    staleness: int = 1
    update_gap_s: float = 0.0  # training step + weight update, from a batch's completion
    update_pause_s: float = 0.0  # the servers pause this long at each weight update
    abort_on_update: bool = False  # in-flight turns are aborted at a weight update and sent again

    @property
    def is_async(self) -> bool:
        return self.batching == "async"

    def slots(self, batch_size: int) -> int:
        return max(1, batch_size // self.trajectories_per_slot) if self.is_async else batch_size


@dataclass(frozen=True)
class Profile:
    """Everything the predictor needs (module docstring); method symbols are derived properties."""

    key: ProfileKey
    provenance: Provenance
    batch_size: int  # B
    max_context_tokens: int
    engine: EngineProfile
    workload: WorkloadPools
    decode_fraction: float  # f: time-averaged share of live trajectories decoding (as measured)
    t_over_s: float = 0.0  # T_over: per-turn overhead, fitted from step makespans; 0 until then
    overhead_residual_s: float = 0.0  # signed EMA of the per-turn makespan residual; T_over is its positive part
    group_size: int = 1
    steps_observed: int = 0  # telemetry steps folded in
    rollout: Rollout = field(default_factory=Rollout)
    # per mode that ran ("colocated", "split"): (mode, steps, EMA of log(measured / predicted) step
    # time, EMA of its square), from the tracker; a mode absent here has not run and is predicted by
    # the model alone
    mode_corrections: tuple[tuple[str, int, float, float], ...] = ()
    fit: dict[str, Any] = field(default_factory=dict, compare=False)  # how the last refit went

    def mode_correction(self, mode: str) -> tuple[int, float, float]:
        """(steps, mean log ratio, mean squared log ratio) of `mode`; (0, 0, 0) when it never ran."""
        return next(((n, m, q) for name, n, m, q in self.mode_corrections if name == mode), (0, 0.0, 0.0))

    def mode_adjustment(self, mode: str) -> tuple[float, float]:
        """(factor, error): what the model's step time in `mode` is multiplied by, and the relative
        error left on the result (a standard deviation in log terms).

        The model's error in a mode is taken as normal with sd MODEL_ERROR before anything ran in it;
        each step that ran measures it with the steps' own spread (the mean squared residual less the
        squared mean, at least STEP_NOISE_MIN): the factor is the posterior mean, shrunk toward 1 as
        few or noisy steps warrant, and the error the posterior sd. A mode that never ran keeps
        (1, MODEL_ERROR)."""
        n, m, q = self.mode_correction(mode)
        if n == 0:
            return 1.0, MODEL_ERROR
        noise = max(q - m * m, STEP_NOISE_MIN**2) if n > 1 else STEP_NOISE_PRIOR**2
        prior = MODEL_ERROR**2
        weight = n * prior / (n * prior + noise)
        return math.exp(weight * m), math.sqrt(prior * noise / (n * prior + noise))

    @cached_property
    def sample(self) -> TrajectorySample:
        """The synthetic trajectories the predictor times (deterministic)."""
        return draw_trajectories(self.workload, self.max_context_tokens, SAMPLE_SIZE)

    # -- the method's symbols -----------------------------------------------------------------

    @cached_property
    def S(self) -> float:  # noqa: N802 - the method's symbol
        """Expected turns of the slowest of B trajectories: E[max of B draws], context cap included."""
        return expected_max(self.sample.turns, self.batch_size)

    @cached_property
    def _turns_total(self) -> float:
        return float(self.sample.turns.sum())

    @cached_property
    def r(self) -> float:
        """Tokens generated per turn."""
        return float(self.sample.gen.sum()) / self._turns_total

    @cached_property
    def delta_l(self) -> float:
        """ΔL: new prompt tokens per turn (the prompt, then each observation)."""
        return float(self.sample.prompt.sum() + self.sample.obs.sum()) / self._turns_total

    @cached_property
    def env_per_turn_s(self) -> float:
        return float(self.sample.env.sum()) / self._turns_total

    @cached_property
    def T_env(self) -> float:  # noqa: N802
        """Environment time along the slowest trajectory: S turns at the mean environment time."""
        return self.S * self.env_per_turn_s

    @cached_property
    def mean_context_tokens(self) -> float:
        """Mean context a turn decodes over: the context at which A, b and t_p are quoted."""
        s = self.sample
        start = s.prompt[:, None] + np.cumsum(s.gen + s.obs, axis=1) - s.gen - s.obs
        runs = s.gen > 0
        return float(((start + s.gen / 2) * runs).sum() / runs.sum())

    @cached_property
    def truncated_fraction(self) -> float:
        return float(self.sample.truncated.mean())

    @property
    def f(self) -> float:
        return self.decode_fraction

    @property
    def theta(self) -> float:
        """θ = (1 - f) / f."""
        return (1.0 - self.decode_fraction) / self.decode_fraction

    @cached_property
    def _ab(self) -> tuple[float, float]:
        hint = max(1.0, self.decode_fraction * self.batch_size / BATCH_HINT_WORKERS)
        return self.engine.a_b(self.mean_context_tokens, hint)

    @property
    def A(self) -> float:  # noqa: N802
        return self._ab[0]

    @property
    def b(self) -> float:
        return self._ab[1]

    @property
    def t_p(self) -> float:
        """Prefill seconds per token at the mean context."""
        return float(self.engine.prefill_s_per_token_at(self.mean_context_tokens))

    @property
    def K(self) -> float:  # noqa: N802
        return self.engine.kv_bytes_per_token

    @property
    def BW(self) -> float:  # noqa: N802
        return self.engine.kv_bandwidth_bps

    def symbols(self) -> dict[str, float]:
        """The method's symbols, for `plan --explain` and the decisions table."""
        return {
            "B": self.batch_size,
            "S": self.S,
            "dL": self.delta_l,
            "r": self.r,
            "t_p": self.t_p,
            "A": self.A,
            "b": self.b,
            "T_over": self.t_over_s,
            "T_env": self.T_env,
            "K": self.K,
            "BW": self.BW,
            "f": self.f,
            "theta": self.theta,
            "kv_capacity_tokens": self.engine.kv_capacity_tokens,
            "mean_context_tokens": self.mean_context_tokens,
            "truncated_fraction": self.truncated_fraction,
        }


def expected_max(values: np.ndarray, n: int) -> float:
    """E[max of n draws with replacement] from the empirical distribution of `values`.

    With v_(1) <= ... <= v_(K): sum_i v_(i) * ((i/K)^n - ((i-1)/K)^n).
    """
    v = np.sort(np.asarray(values, dtype=float))
    k = len(v)
    i = np.arange(1, k + 1, dtype=float)
    return float(v @ ((i / k) ** n - ((i - 1) / k) ** n))


def quantile_pool(values: Any, levels: Any, weights: Any = None) -> tuple[float, ...]:
    """The quantiles at CDF `levels` of the (weighted) empirical distribution of `values` (the
    inverse CDF, a step function: discrete quantities such as turns stay discrete)."""
    v = np.asarray(values, dtype=float)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cdf = np.cumsum(w) / w.sum()
    idx = np.searchsorted(cdf, np.asarray(levels, dtype=float), side="left")
    return tuple(float(x) for x in v[np.minimum(idx, len(v) - 1)])


# -- builders -------------------------------------------------------------------------------------


def engine_from_perf(perf: PerfModel) -> EngineProfile:
    """The catalog prior: the performance model's decode curve, prefill cost, KV transfer and capacity."""
    base = tuple(perf.decode_step_time(n, 0.0) for n in DECODE_BATCHES)
    ctx_ref = 16384.0
    b_ctx = (perf.decode_step_time(8, ctx_ref) - perf.decode_step_time(8, 0.0)) / (8 * ctx_ref)
    t_p0 = perf.prefill_seconds_per_token(PREFILL_CHUNK_TOKENS, 0.0)
    t_pc = (perf.prefill_seconds_per_token(PREFILL_CHUNK_TOKENS, ctx_ref) - t_p0) / ctx_ref
    setup = perf.kv_transfer_time(0)
    decode_only = perf.for_role(Role.DECODE).decode_step_time(8, ctx_ref) / perf.decode_step_time(8, ctx_ref)
    prefill_only = perf.for_role(Role.PREFILL).prefill_seconds_per_token(PREFILL_CHUNK_TOKENS, 0.0) / t_p0
    return EngineProfile(
        decode_batches=DECODE_BATCHES,
        decode_base_s=base,
        decode_s_per_ctx_token=b_ctx,
        prefill_s_per_token=t_p0,
        prefill_s_per_token_per_ctx=t_pc,
        kv_bytes_per_token=perf.model.kv_bytes_per_token,
        kv_bandwidth_bps=perf.model.kv_bytes_per_token / (perf.kv_transfer_time(1.0) - setup),
        kv_setup_s=setup,
        kv_capacity_tokens=perf.kv_capacity_tokens,
        turn_prefix_reuse=perfmodel.TURN_PREFIX_REUSE,  # read now: the engine's value, whatever it is set to
        decode_only_scale=decode_only,
        prefill_only_scale=prefill_only,
    )


def pools_from_workload(workload: Workload, n: int = POOL_SIZE) -> WorkloadPools:
    """The scenario distributions' quantiles at `pool_levels(n)`."""
    levels = pool_levels(n)

    def q(dist: Any) -> tuple[float, ...]:
        return tuple(float(dist.quantile(x)) for x in levels)

    return WorkloadPools(
        prompt_tokens=q(workload.prompt_tokens),
        turns=q(workload.turns),
        gen_tokens=q(workload.gen_tokens_per_turn),
        obs_tokens=q(workload.obs_tokens_per_turn),
        env_s=q(workload.env_latency_s),
        levels=levels,
    )


def profile_from_workload(
    workload: Workload, perf: PerfModel, *, device: str = "catalog", rollout: Rollout | None = None
) -> Profile:
    """The prior: the workload block of a scenario or inventory plus the catalog performance model.

    f is not measured yet: it starts at the share of a turn spent decoding at B/8 sequences per
    worker, r * T_iter / (r * T_iter + mean environment time); the predictor re-solves it anyway.
    """
    engine = engine_from_perf(perf)
    key = ProfileKey(perf.model.name, perf.gpu.name, perf.tp, device)
    pools = pools_from_workload(workload)
    draft = Profile(key, Provenance.CATALOG, workload.batch_size, workload.max_context_tokens, engine, pools, 1.0)
    batch = workload.batch_size / BATCH_HINT_WORKERS
    decode = draft.r * float(engine.decode_iteration_s(batch, draft.mean_context_tokens))
    f = decode / (decode + draft.env_per_turn_s) if decode > 0 else 1.0
    return Profile(
        key=key,
        provenance=Provenance.CATALOG,
        batch_size=workload.batch_size,
        max_context_tokens=workload.max_context_tokens,
        engine=engine,
        workload=pools,
        decode_fraction=min(1.0, max(f, 1e-3)),
        group_size=workload.group_size,
        rollout=rollout or Rollout(),
    )


# -- JSON (the profiles table stores `params` as JSONB) --------------------------------------------

_ADAPTER = TypeAdapter(Profile)


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    return _ADAPTER.dump_python(profile, mode="json")


def profile_from_dict(raw: Any) -> Profile:
    """Rebuild a profile from `profile_to_dict`'s output; BadInput names the faulty field."""
    try:
        profile = _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'profile'}: {e['msg']}" for e in exc.errors())
        raise BadInput(f"profile: {where}") from None
    _check(profile)
    return profile


def _check(p: Profile) -> None:
    e = p.engine
    if len(e.decode_batches) != len(e.decode_base_s) or len(e.decode_batches) < 2:
        raise BadInput("profile: engine.decode_base_s must match engine.decode_batches (at least two points)")
    if list(e.decode_batches) != sorted(set(e.decode_batches)):
        raise BadInput("profile: engine.decode_batches must be strictly increasing")
    numbers = {
        "engine.decode_base_s": min(e.decode_base_s),
        "engine.decode_s_per_ctx_token": e.decode_s_per_ctx_token,
        "engine.prefill_s_per_token": e.prefill_s_per_token,
        "engine.prefill_s_per_token_per_ctx": e.prefill_s_per_token_per_ctx,
        "engine.kv_bytes_per_token": e.kv_bytes_per_token,
        "engine.kv_setup_s": e.kv_setup_s,
        "t_over_s": p.t_over_s,
        "rollout.update_gap_s": p.rollout.update_gap_s,
        "rollout.update_pause_s": p.rollout.update_pause_s,
    }
    for name, v in numbers.items():
        if not math.isfinite(v) or v < 0:
            raise BadInput(f"profile: {name} must be a finite number >= 0 ({v})")
    for name in ("decode_only_scale", "prefill_only_scale"):
        v = getattr(e, name)
        if not math.isfinite(v) or v <= 0:
            raise BadInput(f"profile: engine.{name} must be a finite number > 0 ({v})")
    if p.rollout.batching not in ("sync", "async"):
        raise BadInput(f"profile: rollout.batching must be 'sync' or 'async' ({p.rollout.batching!r})")
    for mode, n, m, q in p.mode_corrections:
        if mode not in ("colocated", "split") or n < 1 or not math.isfinite(m) or not math.isfinite(q) or q < 0:
            raise BadInput(f"profile: mode_corrections: bad entry for {mode!r} (steps {n}, mean {m}, square {q})")
    if p.rollout.trajectories_per_slot < 1 or p.rollout.staleness < 0:
        raise BadInput("profile: rollout.trajectories_per_slot must be >= 1 and rollout.staleness >= 0")
    if not 0 <= e.turn_prefix_reuse <= 1:
        raise BadInput(f"profile: engine.turn_prefix_reuse must be in [0, 1] ({e.turn_prefix_reuse})")
    if not e.kv_bandwidth_bps > 0:
        raise BadInput("profile: engine.kv_bandwidth_bps must be > 0")
    if not 0 < p.decode_fraction <= 1:
        raise BadInput(f"profile: decode_fraction must be in (0, 1] ({p.decode_fraction})")
    if p.batch_size <= 0 or p.max_context_tokens <= 0:
        raise BadInput("profile: batch_size and max_context_tokens must be > 0")
    for name in ("prompt_tokens", "turns", "gen_tokens", "obs_tokens", "env_s"):
        pool = getattr(p.workload, name)
        if not pool:
            raise BadInput(f"profile: workload.{name} must not be empty")
        if any(not math.isfinite(x) or x < 0 for x in pool):
            raise BadInput(f"profile: workload.{name} must hold finite numbers >= 0")
    lv = p.workload.levels
    if lv:
        if any(
            len(getattr(p.workload, name)) != len(lv)
            for name in ("prompt_tokens", "turns", "gen_tokens", "obs_tokens", "env_s")
        ):
            raise BadInput("profile: workload pools must have one value per entry of workload.levels")
        if not all(0 < a < b < 1 for a, b in zip(lv, lv[1:], strict=False)) or not 0 < lv[0] < 1:
            raise BadInput("profile: workload.levels must increase strictly within (0, 1)")
    if max(p.workload.turns) < 1:
        raise BadInput("profile: workload.turns must allow at least one turn")
