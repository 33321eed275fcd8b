"""Catalog of models and GPUs: the published figures the performance model starts from.

The shipped catalog is `catalog/models.yaml` and `catalog/gpus.yaml` (figures from docs/calibration.md);
a user extends or overrides it with YAML files of the same shape (`PEARL_CATALOG`, a path list).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml
from pearl.controlplane.errors import BadInput
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CATALOG_DIR = Path(__file__).with_name("catalog")


class ModelSpec(BaseModel):
    """One model's shape (bf16)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    hidden: int = Field(gt=0)
    layers: int = Field(gt=0)
    q_heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    params: float = Field(gt=0)
    active_params: float = Field(gt=0)
    weight_bytes: float = Field(gt=0)
    kv_bytes_per_token: float = Field(gt=0)
    linear_flops_per_token: float = Field(gt=0)
    attention_flops_per_token_per_ctx: float = Field(gt=0)
    # Mixture of experts: bytes of all experts over all layers, and how many are routed per token.
    expert_bytes: float = Field(default=0.0, ge=0)
    experts: int = Field(default=0, ge=0)
    experts_active: int = Field(default=0, ge=0)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


class GPUSpec(BaseModel):
    """One GPU type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bf16_tflops: float = Field(gt=0)
    hbm_gb: float = Field(gt=0)
    hbm_tbps: float = Field(gt=0)
    nvlink_gbps: float = Field(gt=0)  # achieved GB/s for TP all-reduce
    nic_gbps: float = Field(gt=0)  # GB/s per GPU between nodes (KV and weight transfer)


@dataclass(frozen=True)
class Catalog:
    models: dict[str, ModelSpec]
    gpus: dict[str, GPUSpec]

    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            raise BadInput(f"model: unknown model {name!r} (known: {', '.join(sorted(self.models))})") from None

    def gpu(self, name: str) -> GPUSpec:
        try:
            return self.gpus[name]
        except KeyError:
            raise BadInput(f"gpu: unknown GPU {name!r} (known: {', '.join(sorted(self.gpus))})") from None


def _read_entries(path: Path, kind: type[BaseModel], into: dict) -> None:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BadInput(f"{path}: cannot read catalog file: {exc}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: a catalog file maps names to entries")
    for name, fields in raw.items():
        try:
            into[str(name)] = kind(name=str(name), **(fields or {}))
        except (ValidationError, TypeError) as exc:
            raise BadInput(f"{path}: {name}: {exc}") from None


def load_catalog(extra: tuple[Path, ...] = ()) -> Catalog:
    """The shipped catalog, then each extra file (a `models:` and/or `gpus:` mapping) on top."""
    models: dict[str, ModelSpec] = {}
    gpus: dict[str, GPUSpec] = {}
    _read_entries(CATALOG_DIR / "models.yaml", ModelSpec, models)
    _read_entries(CATALOG_DIR / "gpus.yaml", GPUSpec, gpus)
    for path in extra:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise BadInput(f"{path}: cannot read catalog file: {exc}") from None
        unknown = set(raw) - {"models", "gpus"} if isinstance(raw, dict) else {"<not a mapping>"}
        if unknown:
            raise BadInput(f"{path}: unknown catalog keys {sorted(unknown)} (expected models, gpus)")
        for key, kind, into in (("models", ModelSpec, models), ("gpus", GPUSpec, gpus)):
            for name, fields in (raw.get(key) or {}).items():
                try:
                    into[str(name)] = kind(name=str(name), **(fields or {}))
                except (ValidationError, TypeError) as exc:
                    raise BadInput(f"{path}: {key}.{name}: {exc}") from None
    return Catalog(models=models, gpus=gpus)


LINEAR_EFFICIENCY_CSV = CATALOG_DIR / "h100-7b-linear-efficiency.csv"


@dataclass(frozen=True)
class LinearEfficiencyRow:
    """One row of the shipped kernel-efficiency table (vidur's measured 7B profile on one H100)."""

    tokens: int  # tokens per step
    mfu: float  # linear layers' share of dense bf16 peak (989 TFLOP/s)
    mbu: float  # weight streaming's share of HBM peak (3.35 TB/s)


@cache
def linear_efficiency_table() -> tuple[LinearEfficiencyRow, ...]:
    """The shipped `h100-7b-linear-efficiency.csv`, the figures the performance model's roofline
    efficiencies are fitted to (`perfmodel.fit_linear_efficiency`)."""
    import csv

    with LINEAR_EFFICIENCY_CSV.open(newline="") as f:
        return tuple(LinearEfficiencyRow(int(r["num_tokens"]), float(r["MFU_vs_989"]), float(r["MBU_vs_3350"]))
                     for r in csv.DictReader(f))


@cache
def default_catalog() -> Catalog:
    """The shipped catalog plus the files named in `PEARL_CATALOG` (os.pathsep-separated)."""
    extra = tuple(Path(p) for p in os.environ.get("PEARL_CATALOG", "").split(os.pathsep) if p)
    return load_catalog(extra)
