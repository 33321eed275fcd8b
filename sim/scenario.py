"""Scenario files (docs/formats.md, "Scenario"): validation, `--set` overrides, and preemptible traces.

Errors name the key: `cluster.preemptible.notice_s: Input should be ...`, exit code 2 in the CLI.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.perfmodel import AGENTIC_LOAD, PerfModel
from pearl.controlplane.core.profile import Rollout
from pearl.controlplane.core.validation import format_validation
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.errors import BadInput
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SHIPPED_DIR = Path(__file__).parent  # scenarios/, traces/, inventories/ shipped with pearl
GPUS_PER_NODE = 8  # the simulated cluster's nodes; a worker's tp GPUs are on one node
# Sanity limits: far above the shipped scenarios, low enough that a typo is refused at once instead of
# simulating for hours or exhausting memory.
MAX_SIM_GPUS = 4096  # per pool: training, reserved rollout, preemptible
MAX_DURATION_S = 7 * 24 * 3600.0  # a week of simulated time


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Trace(_Strict):
    """A public spot-trace: GPUs available per tick of `gap_seconds`; past the end the last value holds."""

    gap_seconds: float = Field(gt=0)
    data: tuple[Annotated[int, Field(ge=0)], ...] = Field(min_length=1)  # GPUs available per tick
    source: str = ""

    def gpus_at(self, t: float) -> int:
        i = min(int(t // self.gap_seconds), len(self.data) - 1)
        return self.data[max(i, 0)]


class Preemptible(_Strict):
    trace: Path  # relative to the scenario file
    max_gpus: int = Field(ge=0, le=MAX_SIM_GPUS)
    notice_s: float = Field(ge=0)


class Cluster(_Strict):
    training_gpus: int = Field(ge=0, le=MAX_SIM_GPUS)
    reserved_rollout_gpus: int = Field(ge=0, le=MAX_SIM_GPUS)
    preemptible: Preemptible | None = None


class Training(_Strict):
    """The RL framework's loop (docs/simulator.md, "The trainer")."""

    step_s: float = Field(gt=0)  # one optimizer step on the training GPUs
    staleness: int = Field(default=1, ge=0)
    weight_sync_s: float = Field(default=0.0, ge=0)
    # async: every environment slot runs its trajectories back to back, one per batch, at most
    # `staleness` batches ahead of training (ROLL's async_generation_ratio); sync: each batch starts
    # whole once the previous one is complete (a per-batch barrier)
    batching: Literal["async", "sync"] = "async"
    # at a weight update: keep (pearl's weight sync: the servers pause, running turns keep their
    # progress) or abort (ROLL's: running turns are aborted, their partial output discarded, and
    # re-issued to the new weights; the prefix cache is flushed)
    weight_update: Literal["keep", "abort"] = "keep"
    # trajectories each environment slot runs per batch, one after the other (ROLL's max_traj_per_env):
    # the slots (trajectories rolled out at once) are batch_size / trajectories_per_slot
    trajectories_per_slot: int = Field(default=1, ge=1)

    def rollout(self) -> Rollout:
        """How the predictor sees this loop (profile.Rollout)."""
        return Rollout(batching=self.batching, trajectories_per_slot=self.trajectories_per_slot,
                       staleness=self.staleness, update_gap_s=self.step_s + self.weight_sync_s,
                       update_pause_s=self.weight_sync_s, abort_on_update=self.weight_update == "abort")


class Reconfig(_Strict):
    cold_start_s: float = Field(ge=0)  # start a server (also colocated <-> split, which restarts)
    admit_s: float = Field(ge=0)  # admit a ready group
    role_switch_s: float = Field(ge=0)  # prefill <-> decode in place
    toggle_on_s: float = Field(ge=0)  # borrow a training GPU's worker
    toggle_off_s: float = Field(ge=0)  # return it


class Scenario(_Strict):
    name: str
    model: str
    gpu: str
    tp: int = Field(gt=0)
    cluster: Cluster
    workload: Workload
    training: Training
    reconfig: Reconfig
    duration_s: float = Field(gt=0, le=MAX_DURATION_S)
    seed: int = Field(default=0, ge=0, lt=2**63)  # numpy seeds are non-negative
    # resolved on load, not part of the file
    source: Path | None = Field(default=None, exclude=True)
    trace_data: Trace | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _whole_workers(self) -> Scenario:
        if self.tp > GPUS_PER_NODE:
            raise ValueError(f"tp ({self.tp}) must be at most {GPUS_PER_NODE}: a worker's GPUs are on one node "
                             f"of {GPUS_PER_NODE}")
        per_slot = self.training.trajectories_per_slot
        if self.workload.batch_size % per_slot:
            raise ValueError(f"training.trajectories_per_slot ({per_slot}) must divide workload.batch_size "
                             f"({self.workload.batch_size}): every environment slot runs as many trajectories "
                             "of a batch")
        for key, n in (("cluster.training_gpus", self.cluster.training_gpus),
                       ("cluster.reserved_rollout_gpus", self.cluster.reserved_rollout_gpus)):
            if n % self.tp:
                raise ValueError(f"{key} ({n}) must be a multiple of tp ({self.tp})")
        return self

    @property
    def env_slots(self) -> int:
        """Environment slots: trajectories rolled out at once (a batch over training.trajectories_per_slot)."""
        return self.workload.batch_size // self.training.trajectories_per_slot

    @property
    def max_preemptible_gpus(self) -> int:
        return self.cluster.preemptible.max_gpus if self.cluster.preemptible else 0

    def preemptible_gpus_at(self, t: float) -> int:
        """Usable preemptible GPUs at time t: min(trace, max_gpus), floored to whole workers."""
        if self.cluster.preemptible is None or self.trace_data is None:
            return 0
        n = min(self.trace_data.gpus_at(t), self.cluster.preemptible.max_gpus)
        return n - n % self.tp

    def mean_preemptible_gpus(self) -> float:
        if self.cluster.preemptible is None or self.trace_data is None:
            return 0.0
        ticks = max(1, math.ceil(self.duration_s / self.trace_data.gap_seconds))
        gap = self.trace_data.gap_seconds
        return sum(self.preemptible_gpus_at(k * gap) for k in range(ticks)) / ticks


def _format_error(exc: ValidationError, prefix: str = "") -> str:
    return format_validation(exc, prefix)[0]


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key.path=value` pairs on top of a raw scenario; the value is parsed as YAML."""
    for item in overrides:
        if "=" not in item:
            raise BadInput(f"--set {item!r}: expected key.path=value")
        path, _, text = item.partition("=")
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise BadInput(f"--set {item!r}: empty key")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise BadInput(f"--set {path}: cannot parse value {text!r}: {exc}") from None
        node = raw
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise BadInput(f"--set {path}: {'.'.join(keys[: i + 1])} is not a mapping")
            node = child
        node[keys[-1]] = value
    return raw


_TRACE = "cluster.preemptible.trace"


def load_trace(path: Path) -> Trace:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadInput(f"cluster.preemptible.trace: cannot read {path}: {exc.strerror}", field=_TRACE) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"cluster.preemptible.trace: {path} is not JSON: {exc}", field=_TRACE) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("metadata"), dict):
        raise BadInput(f"cluster.preemptible.trace: {path}: missing metadata", field=_TRACE)
    meta = raw["metadata"]
    try:
        return Trace(gap_seconds=meta.get("gap_seconds"), data=raw.get("data"), source=str(meta.get("source", "")))
    except ValidationError as exc:
        raise BadInput(_format_error(exc, f"cluster.preemptible.trace ({path}): ").replace("gap_seconds",
                       "metadata.gap_seconds"), field=_TRACE) from None


def parse_scenario(raw: Any, source: Path | None = None, overrides: list[str] | None = None) -> Scenario:
    if not isinstance(raw, dict):
        raise BadInput(f"{source or 'scenario'}: a scenario is a mapping of keys")
    raw = apply_overrides(raw, overrides or [])
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as exc:
        message, field = format_validation(exc)
        raise BadInput(message, field=field) from None
    catalog = default_catalog()
    catalog.model(scenario.model)
    catalog.gpu(scenario.gpu)
    trace = None
    if scenario.cluster.preemptible is not None:
        path = scenario.cluster.preemptible.trace
        if not path.is_absolute():
            path = (source.parent if source else Path.cwd()) / path
        trace = load_trace(path)
    return scenario.model_copy(update={"source": source, "trace_data": trace})


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read, override and validate a scenario; a bare name finds a shipped scenario."""
    p = Path(path)
    if not p.exists() and (SHIPPED_DIR / "scenarios" / f"{p.name}.yaml").exists() and p.suffix == "":
        p = SHIPPED_DIR / "scenarios" / f"{p.name}.yaml"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        shipped = ", ".join(s.stem for s in shipped_scenarios())
        raise BadInput(f"--scenario: cannot read {path}: {exc.strerror}; give a scenario file, or one of the "
                       f"shipped scenarios: {shipped}", field="--scenario") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"--scenario: {path} is not a YAML text file (not UTF-8: {exc.reason} at byte {exc.start})",
                       field="--scenario") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BadInput(f"--scenario: {path} is not valid YAML: {exc}", field="--scenario") from None
    return parse_scenario(raw, p.resolve(), overrides)


def shipped_scenarios() -> list[Path]:
    return sorted((SHIPPED_DIR / "scenarios").glob("*.yaml"))


def serving_perf(scenario: Scenario) -> PerfModel:
    """The performance model of one of the scenario's workers as an engine under agentic rollout
    delivers it (`AGENTIC_LOAD`, docs/fidelity.md): what every simulated engine and the predictor's
    prior use."""
    catalog = default_catalog()
    return PerfModel(catalog.model(scenario.model), catalog.gpu(scenario.gpu), scenario.tp, AGENTIC_LOAD)
