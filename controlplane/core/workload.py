"""The workload of agentic rollout: per-trajectory distributions (scenario and inventory `workload:`).

Pure: no I/O. The simulator samples trajectories from it; the predictor uses it as the prior until
telemetry arrives.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # numpy is imported where a sample is drawn: a server that never samples starts faster
    import numpy as np

Z99 = NormalDist().inv_cdf(0.99)
# Sanity limits: far above real RL batches and contexts, low enough that a typo is refused at once
# instead of exhausting memory.
MAX_BATCH_SIZE = 65_536
MAX_CONTEXT_TOKENS = 1_000_000_000  # a cap only: "no truncation" is a large value


class _Dist(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LogNormal(_Dist):
    """Lognormal given its median and 99th percentile, optionally capped at `max` (a limit: values above
    it are `max`; it may lie below the median, when most draws reach the limit)."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    p99: float = Field(gt=0)
    max: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> LogNormal:
        if self.p99 < self.median:
            raise ValueError("p99 must be >= median")
        return self

    @property
    def sigma(self) -> float:
        return (math.log(self.p99) - math.log(self.median)) / Z99

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        import numpy as np

        x = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.minimum(x, self.max) if self.max is not None else x

    def mean(self) -> float:
        if self.max is None:
            return self.median * math.exp(self.sigma**2 / 2)
        # mean of min(X, max) for X lognormal
        mu, s, c = math.log(self.median), self.sigma, math.log(self.max)
        phi = _norm_cdf
        below = math.exp(mu + s * s / 2) * phi((c - mu - s * s) / s) if s > 0 else min(self.median, self.max)
        return below + self.max * (1 - phi((c - mu) / s)) if s > 0 else below

    def quantile(self, q: float) -> float:
        x = self.median * math.exp(self.sigma * _norm_ppf(q))
        return min(x, self.max) if self.max is not None else x


class Constant(_Dist):
    dist: Literal["constant"]
    value: float = Field(ge=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        import numpy as np

        return np.full(n, self.value, dtype=float)

    def mean(self) -> float:
        return self.value

    def quantile(self, q: float) -> float:
        return self.value


class Uniform(_Dist):
    dist: Literal["uniform"]
    low: float = Field(ge=0)
    high: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.high < self.low:
            raise ValueError("high must be >= low")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.uniform(self.low, self.high, n)

    def mean(self) -> float:
        return (self.low + self.high) / 2

    def quantile(self, q: float) -> float:
        return self.low + q * (self.high - self.low)


class Empirical(_Dist):
    dist: Literal["empirical"]
    values: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _non_negative(self) -> Empirical:
        if any(v < 0 or not math.isfinite(v) for v in self.values):
            raise ValueError("values must be finite and >= 0")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        import numpy as np

        return rng.choice(np.asarray(self.values, dtype=float), n)

    def mean(self) -> float:
        import numpy as np

        return float(np.mean(self.values))

    def quantile(self, q: float) -> float:
        import numpy as np

        return float(np.quantile(self.values, q))


Distribution = Annotated[LogNormal | Constant | Uniform | Empirical, Field(discriminator="dist")]


class Workload(BaseModel):
    """Per-trajectory shape of one rollout step (docs/formats.md, scenario `workload:`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = "agentic"  # a free label
    batch_size: int = Field(gt=0, le=MAX_BATCH_SIZE)  # trajectories per rollout step (prompts x group)
    group_size: int = Field(default=1, gt=0)  # trajectories sharing one prompt (GRPO group)
    # a trajectory whose context reaches it ends there (truncated)
    max_context_tokens: int = Field(gt=0, le=MAX_CONTEXT_TOKENS)
    turns: Distribution
    prompt_tokens: Distribution
    obs_tokens_per_turn: Distribution
    gen_tokens_per_turn: Distribution
    env_latency_s: Distribution

    @model_validator(mode="after")
    def _group_divides_batch(self) -> Workload:
        if self.batch_size % self.group_size:
            raise ValueError("batch_size must be a multiple of group_size")
        return self


_STANDARD_NORMAL = NormalDist()
_norm_cdf = _STANDARD_NORMAL.cdf
_norm_ppf = _STANDARD_NORMAL.inv_cdf
