"""Makespan of one rollout step for a configuration: the paper's formulas and pearl's model.

Pure: no I/O; numpy only. The selector ranks configurations with `evaluate` (vectorised over
configurations); `predict` gives one configuration with its components for `plan --explain`.

The paper's formulas (docs/method.md), kept verbatim for comparison:
  colocated     T_c   = S * ((B*ΔL/N) * t_p + r * (A + b*B/N) + T_over) + T_env
  disaggregated T_dec = S * r * (A + b*B/(N_D*(1+θ))) * (1+θ)
                T_pre = S * (B*ΔL*t_p/N_P + B*ΔL*K/BW)
                T_d   = max(T_pre, T_dec) + T_env

pearl's model. Every trajectory j of the profile's sample is timed turn by turn; turn k of every
trajectory is assumed to run while the others still alive run their own turn k ("rounds"), so round
k's load comes from alive(k) = B * P(turns > k) trajectories of mean context ctx(k):
  T_j = Σ_k [ gen_jk * T_iter(n_k, ctx_k) * q_k            decode at the batch of round k
            + prefill_jk                                    new tokens, plus the context on a miss
            + xfer_jk + wait_k + stall_k + T_over ] + env_j
and the makespan is the expected maximum of B draws of T_j (`profile.expected_max`). This models:
- the long tail: late rounds have few trajectories alive, so their iterations cost ~A, not A + bB/N;
  the turns of the slowest trajectory are the maximum of B draws, context cap included;
- the prefix cache, as the simulated engine reuses it: on the worker that holds its prefix (sticky
  routing) a turn reuses the prompt and `turn_prefix_reuse` of the rest of its cached context
  (`perfmodel.TURN_PREFIX_REUSE`: 0 when the chat template drops earlier reasoning, 1 when it
  re-renders every turn verbatim) and prefills the rest and its new tokens; the reusable part too
  when the prefix was evicted (miss rate from the cached footprint over the KV capacity). In split
  mode the prefill worker never computed the previous turn's generated tokens, so each turn
  prefills them too, and the decode worker receives the whole context's KV;
- KV transfer contention: the trajectories of a prefill worker share its NICs (M/D/1 wait), and a
  round cannot be shorter than the prefill or NIC work of the busiest prefill worker (stall);
- KV capacity: a decode worker runs at most capacity/ctx sequences at once; the rest queue (q_k).
Colocated workers interleave prefill with decode: the prefills of the other trajectories on the
worker that land while a trajectory decodes (a share f of them) delay it. The share f of time a
trajectory spends decoding is solved per configuration by a fixed point rather than taken from
the measured f, which belongs to the configuration that was measured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from pearl.controlplane.core.domain import Mode, Role
from pearl.controlplane.core.perfmodel import reusable_prefix
from pearl.controlplane.core.profile import EngineProfile, Profile, TrajectorySample
from pearl.controlplane.errors import BadInput

FIXED_POINT_ITERATIONS = 4  # f converges to <1% in 3-4 iterations on the paper workloads
MAX_UTILISATION = 0.9  # M/D/1 waits are capped here; beyond, the round stretches (stall)
PARTS = ("decode_s", "prefill_s", "kv_transfer_s", "queue_s", "overhead_s", "env_s")  # critical-path components
LEAD_SHARE = 0.12  # the slowest share of the sample that carries the expected maximum ((0.88)^64 ~ 3e-4 left)
SURVIVAL_POINTS = 128  # pass 2 reads alive(τ) from this many order statistics of pass 1 (B/128 resolution)
TAIL_QUANTILE = 0.9  # `tail_s`: time from 90% of trajectories finished to the expected last


@dataclass(frozen=True, order=True)
class Config:
    """A shape of the rollout fleet: N colocated workers, or N_P prefill plus N_D decode workers."""

    n_colocated: int = 0
    n_prefill: int = 0
    n_decode: int = 0

    def __post_init__(self) -> None:
        if min(self.n_colocated, self.n_prefill, self.n_decode) < 0:
            raise BadInput(f"config: worker counts must be >= 0 ({self})")
        if self.n_colocated and (self.n_prefill or self.n_decode):
            raise BadInput("config: all colocated or all split")
        if not self.n_colocated and not (self.n_prefill >= 1 and self.n_decode >= 1):
            raise BadInput("config: a split needs at least one prefill and one decode worker")

    @classmethod
    def colocated(cls, n: int) -> Config:
        return cls(n_colocated=n)

    @classmethod
    def split(cls, n_prefill: int, n_decode: int) -> Config:
        return cls(n_prefill=n_prefill, n_decode=n_decode)

    @property
    def mode(self) -> Mode:
        return Mode.COLOCATED if self.n_colocated else Mode.SPLIT

    @property
    def workers(self) -> int:
        return self.n_colocated + self.n_prefill + self.n_decode

    @property
    def label(self) -> str:
        """'colocated' or e.g. '4P12D' (the `sim ratio` vocabulary)."""
        return "colocated" if self.n_colocated else f"{self.n_prefill}P{self.n_decode}D"

    def __str__(self) -> str:
        return f"colocated x{self.n_colocated}" if self.n_colocated else self.label

    def counts(self) -> dict[Role, int]:
        """Workers per role, as a `Target` wants them."""
        if self.n_colocated:
            return {Role.COLOCATED: self.n_colocated}
        return {Role.PREFILL: self.n_prefill, Role.DECODE: self.n_decode}

    @classmethod
    def from_counts(cls, counts: dict[Role, int]) -> Config | None:
        """The config of a fleet's active roles; None when nothing is active or the roles form
        neither shape (mid-way through a mode change, or a split missing one side)."""
        c, p, d = (counts.get(r, 0) for r in (Role.COLOCATED, Role.PREFILL, Role.DECODE))
        if c and not (p or d):
            return cls(n_colocated=c)
        if p and d and not c:
            return cls(n_prefill=p, n_decode=d)
        return None


@dataclass(frozen=True)
class Prediction:
    """Predicted makespan of one configuration and the critical path's components (seconds)."""

    config: Config
    makespan_s: float  # expected time to finish the step (the remaining part when remaining < 1)
    feasible: bool
    reason: str  # why it is infeasible, else ""
    components: dict[str, float] = field(default_factory=dict)  # decode, prefill, ... along the critical path
    diagnostics: dict[str, float] = field(default_factory=dict)  # miss rate, utilisations, ...


# -- the paper's formulas -------------------------------------------------------------------------


def makespan_colocated_paper(
    *, S: float, B: float, N: int, delta_l: float, r: float, t_p: float, A: float, b: float, T_over: float, T_env: float
) -> float:
    """T_c = S * ((B*ΔL/N) * t_p + r * (A + b*B/N) + T_over) + T_env (docs/method.md)."""
    return S * ((B * delta_l / N) * t_p + r * (A + b * B / N) + T_over) + T_env


def makespan_disaggregated_paper(
    *,
    S: float,
    B: float,
    N_P: int,
    N_D: int,
    delta_l: float,
    r: float,
    t_p: float,
    A: float,
    b: float,
    theta: float,
    K: float,
    BW: float,
    T_env: float,
) -> float:
    """T_d = max(T_pre, T_dec) + T_env with T_dec = S*r*(A + b*B/(N_D*(1+θ)))*(1+θ) and
    T_pre = S*(B*ΔL*t_p/N_P + B*ΔL*K/BW) (docs/method.md)."""
    t_dec = S * r * (A + b * B / (N_D * (1 + theta))) * (1 + theta)
    t_pre = S * (B * delta_l * t_p / N_P + B * delta_l * K / BW)
    return np.maximum(t_pre, t_dec) + T_env


def predict_paper(profile: Profile, config: Config) -> float:
    """The paper's makespan for `config` with the profile's symbols."""
    p = profile
    common = {"S": p.S, "B": p.batch_size, "delta_l": p.delta_l, "r": p.r, "t_p": p.t_p, "A": p.A, "b": p.b}
    if config.mode is Mode.COLOCATED:
        return makespan_colocated_paper(N=config.n_colocated, T_over=p.t_over_s, T_env=p.T_env, **common)
    return float(
        makespan_disaggregated_paper(
            N_P=config.n_prefill, N_D=config.n_decode, theta=p.theta, K=p.K, BW=p.BW, T_env=p.T_env, **common
        )
    )


# -- pearl's model --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Rows:
    """Per-trajectory matrices (rows: trajectories, columns: rounds = turn index)."""

    gen: np.ndarray  # G[j,k]: tokens generated in turn k
    turn: np.ndarray  # I[j,k]: 1 where turn k exists
    env_turn: np.ndarray  # environment time after turn k
    pre_colocated: np.ndarray  # prefill of turn k on a prefix hit: what is not reused, then the new tokens
    pre_split: np.ndarray  # the same in split mode (previous turn's generation included)
    reusable_colocated: np.ndarray  # CB[j,k]: the reusable context, prefilled again on a miss (times t_p0)
    reusable_split: np.ndarray  # the same in split mode (the prefill worker's cache)
    transfer: np.ndarray  # KV transfer of the context after turn k's prefill (split)

    def take(self, idx: np.ndarray) -> _Rows:
        return _Rows(**{name: getattr(self, name)[idx] for name in self.__dataclass_fields__})


@dataclass(frozen=True, eq=False)
class Workbook:
    """The profile's sample as round-indexed matrices; built once per profile (`prepare` caches it)."""

    profile: Profile
    rows: _Rows  # all K sampled trajectories
    lead: _Rows  # the rows that can be among the slowest of B under any configuration
    lead_matrix: dict[bool, np.ndarray]  # per split flag: [G | CB | CB^2/2 | I] of the lead rows (pass 1's product)
    lead_constant: dict[bool, np.ndarray]  # per split flag: what no configuration changes (prefill, env, ...)
    rows_matrix: dict[bool, np.ndarray]  # the same for all rows (the completion times pass 2 reads its load from)
    rows_constant: dict[bool, np.ndarray]
    lead_weights: np.ndarray  # rank weights of the expected maximum for the lead rows (ranked last)
    weights: np.ndarray  # (K,) rank weights of the expected maximum of B draws
    longest_context: float  # the largest context any sampled turn reaches
    alive: np.ndarray  # (R,) expected trajectories still running in round k (of B, at least 1)
    alive_fraction: np.ndarray  # (R+1,) share of trajectories not done before round k (1 at k=0)
    stats: dict[str, np.ndarray]  # (R,) means over the trajectories alive in round k
    # (decode, end-of-prefill) context of the trajectories decoding at a random moment: turns weighted
    # by the tokens they generate (asynchronous batches, where turns of every index run side by side)
    decoding_context: tuple[float, float]
    # `evaluate`'s results on this workbook by their inputs: successive decisions of a step ask again
    # for the same budgets at the same remaining share (about half the calls of a simulated run)
    evaluations: dict[tuple, Evaluation] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def sums(self) -> dict[str, Any]:
        """Sums and means of the sample that no configuration changes (asynchronous batches read
        them on every evaluation): computed once per workbook."""
        rows = self.rows
        turns = rows.turn.sum(axis=0)
        ctx_decode, ctx_end = self.decoding_context
        st = {k: v[:, None] for k, v in self.stats.items()}
        st["ctx_decode"] = np.full_like(st["ctx_decode"], ctx_decode)  # the others decoding beside a turn
        st["ctx_end"] = np.full_like(st["ctx_end"], ctx_end)
        return {
            "turns": turns,
            "weight": turns / turns.sum(),
            "async_st": st,
            "mix": {k: float(turns @ v / turns.sum()) for k, v in self.stats.items()} | {"ctx_decode": ctx_decode,
                                                                                      "ctx_end": ctx_end},
            "mean_row": {split: m.mean(axis=0) for split, m in self.rows_matrix.items()},
            "mean_constant": {split: c.mean() for split, c in self.rows_constant.items()},
            "gen_sum": rows.gen.sum(axis=0),
            "gen_sq_sum": (rows.gen**2).sum(axis=0),
            "gen_mean": rows.gen.mean(axis=0),
            "turn_mean": rows.turn.mean(axis=0),
            "prefill_mean": {False: rows.pre_colocated.sum(axis=1).mean(), True: rows.pre_split.sum(axis=1).mean()},
            "transfer_mean": rows.transfer.sum(axis=1).mean(),
            "env_mean": rows.env_turn.sum(axis=1).mean(),
        }


@functools.lru_cache(maxsize=16)
def prepare(profile: Profile) -> Workbook:
    """Round-indexed matrices of the profile's trajectory sample (cached per profile).

    The expected maximum of B draws puts (1 - q)^B of its weight below the top share q of the
    sample: pass 1 ranks configurations on the rows in the top LEAD_SHARE under any of three
    reference per-token costs (decode alone, at B/8 and at B sequences), which carries all but
    ~(1 - LEAD_SHARE)^B of the weight.
    """
    return _workbook(profile, profile.sample, batch=False)


def predict_batch(profile: Profile, config: Config, batch: TrajectorySample) -> Prediction:
    """The makespan of one known batch (its own slowest trajectory, no expectation over draws):
    what the tracker compares a step's observed makespan with, free of the batch's sampling noise."""
    wb = _workbook(profile, batch, batch=True)
    if config.mode is Mode.COLOCATED:
        ev = evaluate(wb, False, np.array([config.n_colocated]))
    else:
        ev = evaluate(wb, True, np.array([config.n_prefill]), np.array([config.n_decode]))
    return ev.prediction(0, config)


def _workbook(profile: Profile, s: TrajectorySample, batch: bool) -> Workbook:
    """The matrices of a sample; `batch`: the sample is the step itself (weights on its maximum)."""
    e = profile.engine
    k_n = len(s.turns)
    big_b = k_n if batch else profile.batch_size
    turn = (s.gen > 0).astype(float)
    new = np.hstack([s.prompt[:, None], s.obs[:, :-1]]) * turn
    ctx_end = (np.cumsum(new, axis=1) + np.cumsum(s.gen, axis=1) - s.gen) * turn  # after turn k's prefill
    ctx_before = ctx_end - new
    new_split = (new + np.pad(s.gen[:, :-1], ((0, 0), (1, 0)))) * turn  # the prefill worker never saw them
    cached_split = ctx_end - new_split  # what the prefill worker cached of the context (before the last turn's tokens)
    reusable = {split: reusable_prefix(own, s.prompt[:, None], e.turn_prefix_reuse) * turn
                for split, own in ((False, ctx_before), (True, cached_split))}

    def prefill(tokens: np.ndarray, scale: float = 1.0) -> np.ndarray:
        return scale * (e.prefill_s_per_token * tokens + e.prefill_s_per_token_per_ctx * tokens * ctx_before)

    def again(own: np.ndarray, kept: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """Prefill of the cached context beyond the reused part, `kept` tokens before it."""
        return scale * (e.prefill_s_per_token * (own - kept) + e.prefill_s_per_token_per_ctx * (own**2 - kept**2) / 2)

    rows = _Rows(
        gen=s.gen,
        turn=turn,
        env_turn=s.env,
        pre_colocated=prefill(new) + again(ctx_before, reusable[False]),
        pre_split=prefill(new_split, e.prefill_only_scale) + again(cached_split, reusable[True], e.prefill_only_scale),
        reusable_colocated=reusable[False],
        reusable_split=reusable[True],
        transfer=e.kv_transfer_s(ctx_end) * turn,
    )
    count = turn.sum(axis=0)

    def mean(m: np.ndarray) -> np.ndarray:
        return (m * turn).sum(axis=0) / np.maximum(count, 1)

    ctx = float(mean(ctx_end + s.gen / 2).mean())
    lead: set[int] = set(range(k_n)) if batch else set()
    top = max(1, int(np.ceil(LEAD_SHARE * k_n)))
    for seqs in () if batch else (1.0, big_b / 8, float(big_b)):
        t = s.gen.sum(axis=1) * float(e.decode_iteration_s(max(seqs, 1.0), ctx)) + s.env.sum(axis=1)
        lead.update(np.argpartition(t, k_n - top)[k_n - top :].tolist())
    lead_idx = np.array(sorted(lead))
    lr = rows.take(lead_idx)
    matrix = {split: np.hstack([rows.gen, cb, cb**2 / 2, rows.turn]) for split, cb in reusable.items()}
    env = rows.env_turn.sum(axis=1)  # T_over is in the per-turn `extra` cost
    constant = {
        False: rows.pre_colocated.sum(axis=1) + env,
        True: rows.pre_split.sum(axis=1) + rows.transfer.sum(axis=1) + env,
    }
    i = np.arange(1, k_n + 1, dtype=float)
    weights = np.eye(1, k_n, k_n - 1)[0] if batch else (i / k_n) ** big_b - ((i - 1) / k_n) ** big_b
    return Workbook(
        profile=profile,
        rows=rows,
        lead=lr,
        lead_matrix={split: m[lead_idx] for split, m in matrix.items()},
        lead_constant={split: c[lead_idx] for split, c in constant.items()},
        rows_matrix=matrix,
        rows_constant=constant,
        lead_weights=weights[k_n - len(lead_idx) :],
        weights=weights,
        longest_context=float((ctx_end + s.gen).max()),
        alive=np.maximum(big_b * count / k_n, 1.0),
        decoding_context=(float(((ctx_end + s.gen / 2) * s.gen).sum() / max(float(s.gen.sum()), 1.0)),
                          float((ctx_end * s.gen).sum() / max(float(s.gen.sum()), 1.0))),
        alive_fraction=np.concatenate([[1.0], count[1:] / k_n, [0.0]]),
        stats={
            "gen": mean(s.gen),
            "ctx_decode": mean(ctx_end + s.gen / 2),
            "ctx_before": mean(ctx_before),
            "ctx_end": mean(ctx_end),
            "new_colocated": mean(new),
            "new_split": mean(new_split),
            "again_colocated": mean(ctx_before - reusable[False]),  # prefilled again on a hit
            "again_split": mean(cached_split - reusable[True]),
            "reusable_colocated": mean(reusable[False]),  # prefilled again on a miss too
            "reusable_split": mean(reusable[True]),
            "env": mean(s.env),
            "transfer": mean(e.kv_transfer_s(ctx_end)),
        },
    )


@dataclass(frozen=True, eq=False)
class _Costs:
    """Per-turn costs of one round under a load (arrays over rounds or trajectories x configurations)."""

    per_token: np.ndarray  # seconds per generated token: the decode iteration, KV queueing included
    miss: np.ndarray  # prefix-cache miss rate
    extra: np.ndarray  # seconds per turn besides own decode, prefill and transfer (interference, waits)
    f: np.ndarray  # share of a turn spent decoding under this load
    diagnostics: dict[str, np.ndarray]


def _round_costs(wb: Workbook, split: bool, st: dict, alive: Any, n1: Any, n2: Any, f: Any,
                 mix: dict | None = None) -> _Costs:
    """Costs of a turn when `alive` trajectories run; n1 = N (colocated) or N_P, n2 = N_D (split).

    `st` holds the turn's own means (per round); the others' load is read from `mix` when given
    (asynchronous batches: the mean turn over every round, as turns of every index run side by side)
    and from `st` otherwise (rounds in lock-step)."""
    p, e = wb.profile, wb.profile.engine
    others = st if mix is None else mix
    cap = float(e.kv_capacity_tokens)
    ctx = st["ctx_decode"]
    scale = _prefill_scale(e, split)
    tp = e.prefill_s_per_token_at(st["ctx_before"]) * scale
    tp_others = tp if mix is None else e.prefill_s_per_token_at(mix["ctx_before"]) * scale
    if not split:
        m = 1 + (alive - 1) / n1  # trajectories on a worker (sticky routing, even spread)
        miss = np.clip(1 - cap / (m * st["ctx_end"]), 0.0, 1.0)
        pre = _turn_prefill_tokens(st, split, miss) * tp
        pre_others = _turn_prefill_tokens(others, split, miss) * tp_others
        dec = 1 + f * (m - 1)
        queue = np.maximum(1.0, dec * ctx / cap)  # KV admission: capacity/ctx sequences run at once
        per_token = e.decode_iteration_s(dec / queue, ctx) * queue
        interference = f * (m - 1) * pre_others  # others' prefills landing while this one decodes
        decode = st["gen"] * per_token
        f_new = decode / (decode + pre + interference + st["env"] + p.t_over_s)
        return _Costs(per_token, miss, interference + p.t_over_s, f_new, {"kv_utilisation": dec * ctx / cap})
    m_p = alive / n1  # trajectories per prefill worker (sticky: their prefixes live there)
    miss = np.clip(1 - cap / (m_p * st["ctx_end"]), 0.0, 1.0)
    pre = _turn_prefill_tokens(st, split, miss) * tp
    xfer = st["transfer"]
    dec = np.maximum(1.0, 1 + (f * alive - 1) / n2)
    queue = np.maximum(1.0, dec * ctx / cap)
    per_token = e.decode_iteration_s(dec / queue, ctx) * queue * e.decode_only_scale
    decode = st["gen"] * per_token
    if mix is None:
        pre_o, xfer_o, rnd_o = pre, xfer, decode + pre + xfer + st["env"] + p.t_over_s
    else:
        pre_o = _turn_prefill_tokens(mix, split, miss) * tp_others
        xfer_o = mix["transfer"]
        rnd_o = mix["gen"] * per_token + pre_o + xfer_o + mix["env"] + p.t_over_s
    # Each prefill worker's compute and NICs serve its m_p trajectories every round (a turn of each,
    # a round being a turn's unloaded length); the receiving side spreads over N_D workers' NICs:
    # contention is on the busier side.
    load_pre, load_nic = m_p * pre_o, np.maximum(m_p, alive / n2) * xfer_o
    wait = _md1_wait(load_pre / rnd_o, pre_o) + _md1_wait(load_nic / rnd_o, xfer_o)
    if mix is not None:
        # no lock-step rounds: each trajectory comes back a turn's length, its waits included, after
        # its last request, so the arrival rate is what the waits leave (solved by iteration)
        for _ in range(WAIT_ITERATIONS):
            cycle = rnd_o + wait
            wait = _md1_wait(load_pre / cycle, pre_o) + _md1_wait(load_nic / cycle, xfer_o)
    stall = np.maximum(0.0, np.maximum(load_pre, load_nic) - (rnd_o + wait))
    f_new = decode / (decode + pre + xfer + st["env"] + p.t_over_s + wait + stall)
    diagnostics = {
        "kv_utilisation": dec * ctx / cap,
        "nic_utilisation": load_nic / rnd_o,
        "prefill_utilisation": load_pre / (rnd_o + wait),
    }
    return _Costs(per_token, miss, wait + stall + p.t_over_s, f_new, diagnostics)


def _prefill_scale(e: EngineProfile, split: bool) -> float:
    """A prefill worker's prefill relative to a colocated worker's (1 when colocated)."""
    return e.prefill_only_scale if split else 1.0


def _turn_prefill_tokens(st: dict, split: bool, miss: Any) -> Any:
    """Mean tokens a turn prefills: its new tokens, the cached context it does not reuse, and the
    reusable part on a prefix miss."""
    mode = "split" if split else "colocated"
    return st[f"new_{mode}"] + st[f"again_{mode}"] + miss * st[f"reusable_{mode}"]


def _md1_wait(rho: np.ndarray, service: np.ndarray) -> np.ndarray:
    """M/D/1 mean wait ρ s / (2(1-ρ)), ρ capped at MAX_UTILISATION (beyond it the round stalls)."""
    r = np.minimum(rho, MAX_UTILISATION)
    return r * service / (2 * (1 - r))


@dataclass(frozen=True, eq=False)
class Evaluation:
    """Results over C configurations of one mode."""

    makespan_s: np.ndarray  # (C,) expected (remaining) makespan
    feasible: np.ndarray  # (C,) bool
    reasons: list[str]  # "" when feasible
    refined: np.ndarray  # (C,) bool: the time-aware tail pass was applied
    components: dict[str, np.ndarray]  # name -> (C,) along the critical path (refined configs only)
    diagnostics: dict[str, np.ndarray]  # name -> (C,)
    # the round model's keys the `refine` best were chosen by, one (C,) array per choice, in order
    # (lock-step: pass 1's makespan; asynchronous: the mean trajectory time of each load iteration)
    screens: tuple[np.ndarray, ...] = ()

    def prediction(self, i: int, config: Config) -> Prediction:
        """The i-th configuration's result as a Prediction."""
        return Prediction(
            config=config,
            makespan_s=float(self.makespan_s[i]),
            feasible=bool(self.feasible[i]),
            reason=self.reasons[i],
            components={name: float(v[i]) for name, v in self.components.items()},
            diagnostics={name: float(v[i]) for name, v in self.diagnostics.items()},
        )


EVALUATIONS_KEPT = 512  # per workbook; then the memo starts again (a policy loop runs for days)


def evaluate(
    wb: Workbook,
    split: bool,
    n1: np.ndarray,
    n2: np.ndarray | None = None,
    remaining_fraction: float = 1.0,
    refine: int | None = None,
    include: tuple[int, ...] = (),
) -> Evaluation:
    """Predict C configurations of one mode at once: N = n1 colocated, or N_P = n1, N_D = n2 split.

    Pass 1 (all configurations): the round model, alive(k) from turn counts. Pass 2 (the `refine`
    best of pass 1 and the indices in `include`; all when `refine` is None): the slowest
    trajectories are re-timed turn by turn with the load at the time each turn actually runs,
    alive(τ) = B * P(T > τ) from pass 1: the last trajectories run when most others are done, at
    small batches.

    A pure function of its inputs, remembered on the workbook: a repeated question gets the same
    (read-only) Evaluation without the work.
    """
    n1 = np.asarray(n1, dtype=float)
    n2 = np.zeros_like(n1) if n2 is None else np.asarray(n2, dtype=float)
    key = (split, n1.tobytes(), n2.tobytes(), float(remaining_fraction), refine, tuple(int(i) for i in include))
    found = wb.evaluations.get(key)
    if found is None:
        found = _corrected(wb, split, _evaluate(wb, split, n1, n2, remaining_fraction, refine, include))
        for array in (found.makespan_s, found.feasible, found.refined, *found.components.values(),
                      *found.diagnostics.values(), *found.screens):
            array.flags.writeable = False
        if len(wb.evaluations) >= EVALUATIONS_KEPT:
            wb.evaluations.clear()
        wb.evaluations[key] = found
    return found


SEARCH_GRID = 64  # `search`: the first look at the configurations; fewer than twice this are all evaluated


def search(
    wb: Workbook,
    split: bool,
    n1: np.ndarray,
    n2: np.ndarray | None = None,
    remaining_fraction: float = 1.0,
    refine: int = 16,
    include: tuple[int, ...] = (),
) -> tuple[np.ndarray, Evaluation]:
    """`evaluate` of C configurations ordered along one axis (a budget's splits by N_P), searched:
    the indices evaluated (ascending) and their Evaluation, which holds everything the exhaustive
    evaluation would choose from.

    The round model's keys (`Evaluation.screens`) are unimodal along N_P: few prefill workers keep
    decode waiting, few decode workers queue it. A grid of SEARCH_GRID configurations, screened by
    the first key alone, brackets its smallest; the bracket is evaluated in full, and widened (by at
    least `refine`, doubling) while one of its ends is among the `refine` best by a key or predicts
    no worse than the best feasible configuration in it. Past an end that is neither, a unimodal key
    only grows, and so does the round-model prediction of a configuration the tail model does not
    re-time: the exhaustive ranking's `refine` best and its best feasible lie inside."""
    n1 = np.asarray(n1, dtype=float)
    n2 = np.zeros_like(n1) if n2 is None else np.asarray(n2, dtype=float)
    c_n, inc = len(n1), np.asarray(include, dtype=int)
    if c_n < 2 * SEARCH_GRID:
        return np.arange(c_n), evaluate(wb, split, n1, n2, remaining_fraction, refine, include)
    grid = np.unique(np.linspace(0, c_n - 1, SEARCH_GRID).round().astype(int))
    g = int(np.argmin(_screen(wb, split, n1[grid], n2[grid])))
    lo, hi = int(grid[max(g - 1, 0)]), int(grid[min(g + 1, len(grid) - 1)])
    while True:
        idx = np.union1d(np.arange(lo, hi + 1), inc)
        ev = evaluate(wb, split, n1[idx], n2[idx], remaining_fraction, refine,
                      tuple(np.searchsorted(idx, inc).tolist()))
        step = max(refine, hi - lo)
        wider_lo = lo > 0 and _open_end(ev, int(np.searchsorted(idx, lo)), refine)
        wider_hi = hi < c_n - 1 and _open_end(ev, int(np.searchsorted(idx, hi)), refine)
        if not (wider_lo or wider_hi):
            return idx, ev
        lo, hi = (max(0, lo - step) if wider_lo else lo), (min(c_n - 1, hi + step) if wider_hi else hi)


def _open_end(ev: Evaluation, i: int, refine: int) -> bool:
    """Whether configuration i of `ev`, an end of the searched bracket, is among the `refine` best by
    a key or predicts no worse than the best feasible one: then the bracket must widen past it."""
    if ev.makespan_s[i] <= np.min(ev.makespan_s[ev.feasible], initial=np.inf):
        return True
    k = min(refine, len(ev.makespan_s)) - 1
    return any(key[i] <= np.partition(key, k)[k] for key in ev.screens)


def _screen(wb: Workbook, split: bool, n1: np.ndarray, n2: np.ndarray) -> np.ndarray:
    """The first key `evaluate` ranks by (`Evaluation.screens[0]`), alone."""
    if wb.profile.rollout.is_async:
        slots = float(wb.profile.rollout.slots(wb.profile.batch_size))
        return _async_pass(wb, split, n1, n2, np.full(len(n1), slots))[2]
    return _pass1(wb, split, n1, n2)[4]


def _corrected(wb: Workbook, split: bool, ev: Evaluation) -> Evaluation:
    """The model's step times in a mode that ran, times the profile's correction for that mode
    (`Profile.mode_adjustment`); its remaining error is reported as `model_error`."""
    factor, error = wb.profile.mode_adjustment((Mode.SPLIT if split else Mode.COLOCATED).value)
    n = len(ev.makespan_s)
    diagnostics = ev.diagnostics | {"mode_correction": np.full(n, factor), "model_error": np.full(n, error)}
    return replace(ev, makespan_s=ev.makespan_s * factor, diagnostics=diagnostics)


def _evaluate(wb: Workbook, split: bool, n1: np.ndarray, n2: np.ndarray, remaining_fraction: float,
              refine: int | None, include: tuple[int, ...]) -> Evaluation:
    """`evaluate`'s work, done afresh."""
    if wb.profile.rollout.is_async:
        return _evaluate_async(wb, split, n1, n2, remaining_fraction, refine, include)
    st, costs, f, coefficients, makespan = _pass1(wb, split, n1, n2)
    screen = makespan.copy()
    if refine is None:
        chosen = np.arange(len(n1))
    else:
        chosen = np.union1d(np.argsort(makespan, kind="stable")[:refine], np.asarray(include, dtype=int))
    components = {name: np.full(len(n1), np.nan) for name in PARTS}
    tail = np.full(len(n1), np.nan)
    if len(chosen):
        pass1 = wb.rows_matrix[split] @ coefficients[:, chosen] + wb.rows_constant[split][:, None]
        now = _boundary(wb, remaining_fraction)
        total, top, parts, at_top = _refine(wb, split, n1[chosen], n2[chosen], f[:, chosen], pass1, now)
        order = np.argsort(total, axis=0, kind="stable")
        makespan[chosen] = wb.weights @ np.take_along_axis(total, order, axis=0)
        if remaining_fraction < 1:
            # Remaining time from now, when R/B remain: each trajectory's own time left after the
            # boundary `now` (the re-timed rows from pass 2; the others by the round model), then the
            # expected maximum over what is left. Subtracting a round-model elapsed time from the
            # pass-2 makespan would mix two models and rank budgets wrongly mid-step.
            elapsed = _elapsed(wb, split, st, costs, remaining_fraction)[chosen]
            at = np.minimum(np.broadcast_to(elapsed, total.shape), total)
            np.put_along_axis(at, top, at_top, axis=0)
            left = np.sort(np.maximum(total - at, 0.0), axis=0)
            remaining_chosen = wb.weights @ left
        # the critical path's components: the slowest rows carry all but ~(1 - LEAD_SHARE)^B of the weight
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(len(total))[:, None], axis=0)
        w_top = wb.weights[np.take_along_axis(rank, top, axis=0)]
        w_top = w_top / np.maximum(w_top.sum(axis=0), 1e-300)
        for name, m in parts.items():
            components[name][chosen] = (m * w_top).sum(axis=0)
        tail[chosen] = makespan[chosen] - np.quantile(total, TAIL_QUANTILE, axis=0)
    weight = wb.rows.turn.sum(axis=0) / wb.rows.turn.sum()
    diagnostics = {
        "tail_s": tail,
        "prefix_miss_rate": weight @ costs.miss,
        "decode_fraction": weight @ costs.f,
        "kv_utilisation": np.max(costs.diagnostics["kv_utilisation"], axis=0),
    }
    reasons = _feasibility(wb, split, n1, n2, costs, makespan, diagnostics)
    remaining = makespan - _elapsed(wb, split, st, costs, remaining_fraction)
    if remaining_fraction < 1 and len(chosen):
        remaining[chosen] = remaining_chosen
    return _evaluation(remaining, reasons, chosen, components, diagnostics, (screen,))


def _pass1(wb: Workbook, split: bool, n1: np.ndarray, n2: np.ndarray) -> tuple[dict, _Costs, np.ndarray, np.ndarray,
                                                                           np.ndarray]:
    """Pass 1 of lock-step batches: the round model's costs, decode share, coefficients and the
    expected maximum over the lead rows (the makespan the `refine` best are chosen by)."""
    st = {k: v[:, None] for k, v in wb.stats.items()}
    f = np.full((len(wb.alive), len(n1)), wb.profile.decode_fraction)
    for _ in range(FIXED_POINT_ITERATIONS):
        costs = _round_costs(wb, split, st, wb.alive[:, None], n1[None, :], n2[None, :], f)
        f = costs.f
    coefficients = _coefficients(wb.profile.engine, split, costs)
    lead_total = wb.lead_matrix[split] @ coefficients + wb.lead_constant[split][:, None]
    return st, costs, f, coefficients, wb.lead_weights @ np.sort(lead_total, axis=0)


def _coefficients(e: EngineProfile, split: bool, costs: _Costs) -> np.ndarray:
    """Per-round coefficients of the sample's matrices [G | CB | CB^2/2 | I]: seconds per generated
    token, the prefill of the reusable context on a miss (per token, per token and cached token), and
    the per-turn extra."""
    scale = _prefill_scale(e, split)
    return np.vstack([costs.per_token, costs.miss * e.prefill_s_per_token * scale,
                      costs.miss * e.prefill_s_per_token_per_ctx * scale, costs.extra])


def _evaluation(remaining: np.ndarray, reasons: list[str], chosen: np.ndarray, components: dict[str, np.ndarray],
                diagnostics: dict[str, np.ndarray], screens: tuple[np.ndarray, ...]) -> Evaluation:
    """The Evaluation of C configurations; `chosen` those timed in full (the others by a cheaper pass)."""
    refined = np.zeros(len(reasons), dtype=bool)
    refined[chosen] = True
    return Evaluation(
        makespan_s=np.maximum(remaining, 0.0),
        feasible=np.array([not r for r in reasons]),
        reasons=reasons,
        refined=refined,
        components=components,
        diagnostics=diagnostics,
        screens=screens,
    )


# -- asynchronous batches (profile.Rollout.batching "async") ---------------------------------------
#
# Environment slots run trajectories back to back and go on with the next batch at once, so the
# fleet carries about `slots` trajectories all the time, of every turn and context, and a batch is
# complete when the last of its slots is. Each trajectory's time is timed under that constant load
# (the round model with alive = the load and the time-averaged context of the trajectories decoding
# beside it); the interval between batches then comes from running the slots: SLOT_BATCHES batches
# of trajectories drawn from the sample (the same draws for every configuration), each slot
# starting a batch once it exists (`staleness` ahead of the last complete batch, `update_gap_s`
# after it), every weight update pausing the servers and, when it aborts, costing the in-flight
# turns their progress. The load is then refined by the share of time slots wait (twice).

SLOT_BATCHES = 40  # batches run by the slot model per configuration (the first SLOT_WARMUP dropped)
SLOT_WARMUP = 6
SLOT_SEED = 20261204
LOAD_ITERATIONS = 2
WAIT_ITERATIONS = 4  # the prefill wait and the arrival rate it leaves: within 1% after 3-4


@dataclass(frozen=True)
class _SlotRun:
    interval_s: np.ndarray  # (C,) mean time between batch completions
    remaining_s: np.ndarray  # (C,) mean time from `remaining_fraction` of a batch left to its completion
    tail_s: np.ndarray  # (C,) the same from TAIL_QUANTILE of it done
    busy: np.ndarray  # (C,) share of slot time spent running a trajectory


@functools.lru_cache(maxsize=32)
def _slot_draws(k_n: int, slots: int, per_slot: int) -> np.ndarray:
    """(SLOT_BATCHES, slots, per_slot) indices into the sample: which trajectory each slot runs."""
    return np.random.default_rng(SLOT_SEED).integers(0, k_n, size=(SLOT_BATCHES, slots, per_slot))


def _run_slots(wb: Workbook, durations: np.ndarray, delay: np.ndarray, remaining_fraction: float) -> _SlotRun:
    """The slots of profile.rollout over SLOT_BATCHES batches; `durations` (K, C) per trajectory,
    `delay` (C,) what each weight update costs a running slot."""
    p, ro = wb.profile, wb.profile.rollout
    slots, per_slot = ro.slots(p.batch_size), ro.trajectories_per_slot
    draws = _slot_draws(durations.shape[0], slots, per_slot)
    c_n = durations.shape[1]
    batch = slots * per_slot
    left = min(batch - 1, max(0, int(round(remaining_fraction * batch))))  # trajectories still running
    tail_left = min(batch - 1, max(0, int(round((1 - TAIL_QUANTILE) * batch))))
    free = np.zeros((slots, c_n))  # when each slot is free for its next batch
    created = [np.zeros(c_n)] * (ro.staleness + 1)
    complete = np.zeros(c_n)
    intervals, remaining, tails, idle, busy = [], [], [], np.zeros(c_n), np.zeros(c_n)
    for k in range(SLOT_BATCHES):
        start = np.maximum(free, created[k])
        waiting = start - free
        ends = start[:, None, :] + np.cumsum(durations[draws[k]], axis=1)  # (slots, per_slot, C)
        free = ends[:, -1, :] + delay[None, :]
        previous, complete = complete, np.maximum(complete, ends[:, -1, :].max(axis=0))
        created.append(complete + ro.update_gap_s)
        if k >= SLOT_WARMUP:
            order = np.sort(ends.reshape(batch, c_n), axis=0)
            intervals.append(complete - previous)
            remaining.append(complete - np.maximum(previous, order[batch - 1 - left]) if left < batch - 1
                             else complete - previous)
            tails.append(complete - np.maximum(previous, order[batch - 1 - tail_left]))
            idle += waiting.sum(axis=0)
            busy += (ends[:, -1, :] - start).sum(axis=0)
    interval = np.mean(intervals, axis=0)
    remaining_s = interval if remaining_fraction >= 1 else np.mean(remaining, axis=0)
    return _SlotRun(interval, remaining_s, np.mean(tails, axis=0), busy / np.maximum(busy + idle, 1e-300))


def _async_pass(wb: Workbook, split: bool, n1: np.ndarray, n2: np.ndarray,
                load: np.ndarray) -> tuple[_Costs, np.ndarray, np.ndarray]:
    """The round model of asynchronous batches under `load` (C,) concurrent trajectories: the
    costs, the coefficients and the mean trajectory time (C,)."""
    p, sums = wb.profile, wb.sums
    st, mix = sums["async_st"], sums["mix"]
    r_n, c_n = len(wb.alive), len(n1)
    alive = np.broadcast_to(load[None, :], (r_n, c_n))
    f = np.full((r_n, c_n), p.decode_fraction)
    for _ in range(FIXED_POINT_ITERATIONS):
        costs = _round_costs(wb, split, st, alive, n1[None, :], n2[None, :], f, mix)
        f = costs.f
    coefficients = _coefficients(p.engine, split, costs)
    mean_s = sums["mean_row"][split] @ coefficients + sums["mean_constant"][split]
    return costs, coefficients, mean_s


def _evaluate_async(wb: Workbook, split: bool, n1: np.ndarray, n2: np.ndarray, remaining_fraction: float,
                    refine: int | None = None, include: tuple[int, ...] = ()) -> Evaluation:
    """`evaluate` for asynchronous batches (the section's comment). The slots are run for the
    `refine` configurations of smallest mean trajectory time (and those in `include`; all when
    `refine` is None); the others' interval is their mean trajectory time scaled as the run ones'."""
    if not 0 < remaining_fraction <= 1:
        raise BadInput(f"remaining_fraction: must be in (0, 1], got {remaining_fraction}")
    p, ro, sums = wb.profile, wb.profile.rollout, wb.sums
    c_n = len(n1)
    slots, per_slot = ro.slots(p.batch_size), ro.trajectories_per_slot
    weight, mean_row = sums["weight"], sums["mean_row"]
    load = np.full(c_n, float(slots))
    chosen = np.arange(c_n)
    screens = []
    for _ in range(LOAD_ITERATIONS):
        costs, coefficients, mean_s = _async_pass(wb, split, n1, n2, load)
        screens.append(mean_s)
        if refine is not None:
            best = np.argsort(mean_s, kind="stable")[:refine]
            chosen = np.union1d(best, np.asarray(include, dtype=int)).astype(int)
        durations = wb.rows_matrix[split] @ coefficients[:, chosen] + wb.rows_constant[split][:, None]
        decoding = weight @ costs.f
        # an aborted turn loses what it generated: the in-flight one is length-biased, E[T^2] / 2E[T]
        # over the turns' decode times gen * per_token (summed per round, then over rounds)
        first, second = sums["gen_sum"] @ costs.per_token, sums["gen_sq_sum"] @ costs.per_token**2
        lost = decoding * second / (2 * np.maximum(first, 1e-300))
        delay = np.broadcast_to(ro.update_pause_s + (lost if ro.abort_on_update else 0.0), (c_n,)).astype(float)
        run = _run_slots(wb, durations, delay[chosen], remaining_fraction)
        busy = np.full(c_n, float(np.median(run.busy)))
        busy[chosen] = run.busy
        load = np.maximum(slots * busy, 1.0)
    # the configurations not run: their mean trajectory time, times the run ones' median ratios
    little = per_slot * mean_s
    interval, remaining, tail = (np.asarray(little * float(np.median(v / little[chosen]))) for v in
                                 (run.interval_s, run.remaining_s, run.tail_s))
    interval[chosen], remaining[chosen], tail[chosen] = run.interval_s, run.remaining_s, run.tail_s
    gen_mean, turn_mean = sums["gen_mean"], sums["turn_mean"]
    width = wb.rows.gen.shape[1]
    mean_parts = {
        "decode_s": gen_mean @ costs.per_token,
        "prefill_s": sums["prefill_mean"][split] + mean_row[split][width:3 * width] @ coefficients[width:3 * width],
        "kv_transfer_s": np.full(c_n, sums["transfer_mean"] if split else 0.0),
        "queue_s": turn_mean @ (costs.extra - p.t_over_s),
        "overhead_s": np.full(c_n, turn_mean.sum() * p.t_over_s),
        "env_s": np.full(c_n, sums["env_mean"]),
    }
    components = {name: per_slot * v for name, v in mean_parts.items()}
    components["slot_wait_s"] = interval - sum(components.values())
    diagnostics = {
        "tail_s": tail,
        "prefix_miss_rate": weight @ costs.miss,
        "decode_fraction": decoding,
        "kv_utilisation": np.max(costs.diagnostics["kv_utilisation"], axis=0),
        "concurrent_trajectories": load,
        "mean_trajectory_s": mean_s,
    }
    reasons = _feasibility(wb, split, n1, n2, costs, interval, diagnostics, alive=load)
    return _evaluation(remaining, reasons, chosen, components, diagnostics, tuple(screens))


def _boundary(wb: Workbook, remaining_fraction: float) -> tuple[int, float]:
    """The round boundary at which `remaining_fraction` of the trajectories are still alive, as
    (k, w): w of the way from boundary k-1 to boundary k; (0, 0) at the start of a step."""
    if not 0 < remaining_fraction <= 1:
        raise BadInput(f"remaining_fraction: must be in (0, 1], got {remaining_fraction}")
    if remaining_fraction >= 1:
        return 0, 0.0
    frac = wb.alive_fraction  # (R+1,), non-increasing from 1
    k = int(np.argmax(frac <= remaining_fraction))  # first boundary at or below the remaining share
    hi, lo = frac[k - 1], frac[k]
    return k, ((hi - remaining_fraction) / (hi - lo) if hi > lo else 1.0)


def _elapsed(wb: Workbook, split: bool, st: dict, costs: _Costs, remaining_fraction: float) -> np.ndarray:
    """Time by which all but `remaining_fraction` of the trajectories are done: the rounds it takes
    for the alive share to fall to it, at each round's mean duration (0 at the start)."""
    k, w = _boundary(wb, remaining_fraction)
    if k == 0:
        return np.zeros(costs.per_token.shape[1])
    e = wb.profile.engine
    t_p = e.prefill_s_per_token_at(st["ctx_before"]) * _prefill_scale(e, split)
    pre = _turn_prefill_tokens(st, split, costs.miss) * t_p
    rnd = st["gen"] * costs.per_token + pre + costs.extra + st["env"] + (st["transfer"] if split else 0.0)
    times = np.vstack([np.zeros((1, rnd.shape[1])), np.cumsum(rnd, axis=0)])  # (R+1, C) at each round's end
    return times[k - 1] + w * (times[min(k, len(times) - 1)] - times[k - 1])


def _refine(
    wb: Workbook,
    split: bool,
    n1: np.ndarray,
    n2: np.ndarray,
    f: np.ndarray,
    pass1: np.ndarray,
    now: tuple[int, float] = (0, 0.0),
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """Pass 2 (see `evaluate`): re-time the slowest trajectories with the load at their own time.

    Returns the completion times of all rows (K x C, the slowest re-timed), the indices of the
    re-timed rows (top x C), their components (top x C each), and the time at which each re-timed
    row reaches round boundary `now` = (k, w): w of the way from boundary k-1 to k (top x C)."""
    p, e, w = wb.profile, wb.profile.engine, wb.rows
    k_n, c_n = pass1.shape
    top_n = min(k_n, max(1, int(np.ceil(LEAD_SHARE * k_n))))
    top = np.argsort(pass1, axis=0, kind="stable")[k_n - top_n :]  # (top, C); ties: the later rows, as ranked below
    # alive(τ) from pass 1's completion times, SURVIVAL_POINTS order statistics per configuration,
    # all configurations searched in one call (offset so the columns sort one after another)
    ordered = np.sort(pass1, axis=0)
    grid = ordered[np.linspace(0, k_n - 1, SURVIVAL_POINTS).round().astype(int)]
    offsets = np.arange(c_n) * (float(ordered[-1].max()) + 1.0)
    flat = (grid + offsets[None, :]).T.ravel()
    base = np.arange(c_n) * SURVIVAL_POINTS
    pre = w.pre_split if split else w.pre_colocated
    reusable = w.reusable_split if split else w.reusable_colocated
    tau = np.zeros((top_n, c_n))
    k_now, w_now = now
    at = np.zeros((top_n, c_n))  # the time each re-timed row reaches boundary `now`
    acc = {name: np.zeros((top_n, c_n)) for name in PARTS if name != "env_s"}
    for k in range(w.gen.shape[1]):
        if k == k_now - 1:
            at = tau.copy()
        live = w.turn[top, k]
        if not live.any():
            break
        done = np.searchsorted(flat, (tau + offsets[None, :]).ravel(), side="right").reshape(top_n, c_n) - base
        alive = np.maximum(p.batch_size * (1 - done / SURVIVAL_POINTS), 1.0)
        st = {name: v[k] for name, v in wb.stats.items()}
        c = _round_costs(wb, split, st, alive, n1[None, :], n2[None, :], f[k][None, :])
        pieces = {
            "decode_s": w.gen[top, k] * c.per_token,
            "prefill_s": pre[top, k]
            + c.miss
            * _prefill_scale(e, split)
            * (reusable[top, k] * e.prefill_s_per_token + reusable[top, k] ** 2 / 2 * e.prefill_s_per_token_per_ctx),
            "kv_transfer_s": w.transfer[top, k] if split else np.zeros_like(tau),
            "queue_s": c.extra - p.t_over_s,
            "overhead_s": np.full_like(tau, p.t_over_s),
        }
        for name, v in pieces.items():
            acc[name] += v * live
        before = tau.copy()
        tau += sum(pieces.values()) * live + w.env_turn[top, k]
        if k == k_now - 1:
            at = before + w_now * (tau - before)
    total = pass1.copy()
    np.put_along_axis(total, top, tau, axis=0)
    acc["env_s"] = w.env_turn.sum(axis=1)[top]
    return total, top, acc, np.minimum(at, tau)


def _feasibility(
    wb: Workbook, split: bool, n1: np.ndarray, n2: np.ndarray, costs: _Costs, makespan: np.ndarray, diag: dict,
    alive: np.ndarray | None = None,
) -> list[str]:
    """Why each configuration cannot run ("" when it can); fills diag with the utilisations it checks."""
    p, e = wb.profile, wb.profile.engine
    cap = float(e.kv_capacity_tokens)
    common = ""
    if cap <= 0:
        common = "the weights leave no room for a KV cache on one worker"
    elif wb.longest_context > cap:
        common = f"a trajectory's context ({wb.longest_context:.0f} tokens) exceeds a worker's KV ({int(cap)})"
    if not split:
        return [common] * len(n1)
    # docs/method.md: the decode KV must hold the expected concurrent footprint, and prefill must keep up
    if alive is None:
        footprint = np.full(len(n1), np.max(p.decode_fraction * wb.alive * wb.stats["ctx_decode"]))
    else:  # asynchronous batches: a constant load of trajectories at every context
        footprint = p.decode_fraction * alive * float(np.max(wb.stats["ctx_decode"]))
    turns = wb.sums["turns"]
    # a prefill worker's work per round over the round's unstalled length, averaged over the turns
    busy = turns @ costs.diagnostics["prefill_utilisation"] / turns.sum()
    diag["prefill_utilisation"] = busy
    diag["nic_utilisation"] = turns @ costs.diagnostics["nic_utilisation"] / turns.sum()
    reasons = []
    for i in range(len(n1)):
        if common:
            reasons.append(common)
        elif footprint[i] > n2[i] * cap:
            reasons.append(
                f"decode KV too small: {footprint[i]:.0f} tokens decoding at once > {int(n2[i])} x {int(cap)}")
        elif busy[i] > 1:
            reasons.append(f"prefill cannot keep up: {int(n1[i])} prefill workers {busy[i]:.0%} busy")
        else:
            reasons.append("")
    return reasons


def predict(
    profile: Profile, config: Config, remaining_fraction: float = 1.0, wb: Workbook | None = None
) -> Prediction:
    """pearl's prediction for one configuration, with the critical path's components."""
    wb = wb or prepare(profile)
    if config.mode is Mode.COLOCATED:
        ev = evaluate(wb, False, np.array([config.n_colocated]), None, remaining_fraction)
    else:
        ev = evaluate(wb, True, np.array([config.n_prefill]), np.array([config.n_decode]), remaining_fraction)
    return ev.prediction(0, config)


def describe(prediction: Prediction) -> dict[str, Any]:
    """A JSON-able summary (decisions table, `plan --explain --json`)."""
    return {
        "config": prediction.config.label,
        "workers": prediction.config.workers,
        "predicted_s": round(prediction.makespan_s, 3),
        "feasible": prediction.feasible,
        "reason": prediction.reason,
        "components": {k: round(v, 3) for k, v in prediction.components.items()},
        "diagnostics": {k: round(v, 4) for k, v in prediction.diagnostics.items()},
    }
