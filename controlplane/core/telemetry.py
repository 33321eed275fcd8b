"""Telemetry of one rollout step (docs/formats.md): the format the simulator, the demo's trainer and
`pearlctl event telemetry FILE.json` share. Validation names the offending field; NaN, infinities and
negative counts are refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pearl.controlplane.core.domain import Role
from pearl.controlplane.errors import BadInput
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TrajectoryRecord(_Strict):
    """One trajectory of the step: per-turn observation, generation and environment time."""

    turns: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    obs_tokens: list[int]  # tokens the environment appended after each turn
    gen_tokens: list[int]  # tokens generated in each turn
    env_s: list[float]  # environment time after each turn
    truncated: bool = False  # ended at the context cap

    @field_validator("obs_tokens", "gen_tokens")
    @classmethod
    def _counts(cls, v: list[int]) -> list[int]:
        for i, x in enumerate(v):
            if x < 0:
                raise ValueError(f"item {i} is negative ({x})")
        return v

    @field_validator("env_s")
    @classmethod
    def _seconds(cls, v: list[float]) -> list[float]:
        for i, x in enumerate(v):
            if not math.isfinite(x) or x < 0:
                raise ValueError(f"item {i} must be a finite number >= 0 ({x})")
        return v

    @model_validator(mode="after")
    def _per_turn_lengths(self) -> TrajectoryRecord:
        for name in ("obs_tokens", "gen_tokens", "env_s"):
            n = len(getattr(self, name))
            if n not in (self.turns, max(self.turns - 1, 0)):
                raise ValueError(f"{name} has {n} entries for {self.turns} turns")
        return self

    @property
    def generated(self) -> int:
        return sum(self.gen_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + sum(self.obs_tokens) + sum(self.gen_tokens)


class IterationRecord(_Strict):
    """One engine iteration as a worker measured it (optional; fits A, b and t_p)."""

    worker: int | str
    role: Role
    batch: int = Field(ge=0)  # sequences decoding in the iteration
    context_tokens_mean: float = Field(ge=0)
    prefill_tokens: int = Field(ge=0)
    seconds: float = Field(gt=0)


class StepTelemetry(_Strict):
    step: int = Field(ge=0, lt=2**63)  # a PostgreSQL bigint
    batch_size: int = Field(gt=0, le=65_536)  # the workload's sanity limit
    trajectories: list[TrajectoryRecord] = Field(min_length=1)
    iterations: list[IterationRecord] = Field(default_factory=list)
    decode_fraction: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _batch(self) -> StepTelemetry:
        if len(self.trajectories) > self.batch_size:
            raise ValueError(f"{len(self.trajectories)} trajectories for batch_size {self.batch_size}")
        return self


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_telemetry(raw: Any, source: str = "telemetry") -> StepTelemetry:
    try:
        return StepTelemetry.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        msgs = [f"{_field_path(e['loc']) or source}: {e['msg'].removeprefix('Value error, ')}" for e in errors]
        raise BadInput(f"{source}: " + "; ".join(msgs), field=_field_path(errors[0]["loc"]) or None) from None


def load_telemetry(path: str | Path) -> StepTelemetry:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror}", field="FILE") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not a JSON text file (not UTF-8: {exc.reason} at byte {exc.start})",
                       field="FILE") from None
    try:
        raw = json.loads(text, parse_constant=lambda c: float(c))
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: not JSON: {exc}", field="FILE") from None
    return parse_telemetry(raw, str(path))
