"""The cluster inventory file (docs/formats.md, "Inventory"): validation and canonical form.

Pure: no database. Errors name the field (`nodes.2.zone: ...`) and are raised as BadInput, before
anything is written.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import NodeZone
from pearl.controlplane.core.profile import Rollout
from pearl.controlplane.core.validation import format_validation
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.errors import BadInput
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Sane limits: far above any real cluster, low enough that a typo (`gpus: 1000000000`) is refused at
# once instead of filling memory.
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 10_000
MAX_TOTAL_GPUS = 100_000
MAX_TP = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# A node's name becomes a folder (`$PEARL_HOME/run/NAME`), a Celery queue (`node.NAME`) and a log field:
# letters, digits, `.`, `_` and `-`, starting with a letter or digit (so never `..` or `/`).
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# A node's address is where its servers listen: a host name or an IP address, nothing else (no scheme,
# port, path or query: the servers' URLs are built from it).
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                        r"[A-Za-z0-9])?)*$")


def check_node_name(option: str, value: str) -> str:
    """A node name given on a command line (`--node`), held to the inventory's rule before it names a
    folder or a queue."""
    if not re.match(NODE_NAME_PATTERN, value):
        raise BadInput(f"{option}: a node name (letters, digits, '.', '_' and '-', starting with a letter or "
                       f"digit, at most 63), not {value!r}")
    return value


def check_address(value: str) -> str:
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if not _HOST_NAME.match(value):
        raise ValueError(f"a host name or an IP address (no scheme, port or path), not {value!r}")
    return value


class InventoryNode(_Strict):
    name: str = Field(pattern=NODE_NAME_PATTERN)  # unique in the inventory
    zone: NodeZone
    gpus: int = Field(gt=0, le=MAX_GPUS_PER_NODE)  # a multiple of the inventory's tp
    address: str = Field(min_length=1)  # need not be unique: several nodes may share a host

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)


class RolloutLoop(_Strict):
    """How the RL framework forms its batches (the predictor's `profile.Rollout`; docs/formats.md)."""

    batching: Literal["async", "sync"] = "sync"
    trajectories_per_slot: int = Field(default=1, ge=1)
    staleness: int = Field(default=1, ge=0)
    update_gap_s: float = Field(default=0.0, ge=0)  # training step + weight update
    update_pause_s: float = Field(default=0.0, ge=0)  # the servers' pause at a weight update
    abort_on_update: bool = False  # in-flight turns are aborted at a weight update (ROLL's)

    def rollout(self) -> Rollout:
        return Rollout(**self.model_dump())


class Inventory(_Strict):
    model: str  # catalog name
    gpu: str  # catalog name
    tp: int = Field(gt=0, le=MAX_TP)  # GPUs per worker
    nodes: tuple[InventoryNode, ...] = Field(min_length=1, max_length=MAX_NODES)
    workload: Workload | None = None  # the prior until telemetry arrives
    rollout: RolloutLoop | None = None  # the RL loop's batching; None: a per-batch barrier
    # Simulated servers running this many times faster than the wall clock (`pearlctl demo`): every
    # duration pearl measures is multiplied by it before the policy sees it, so that measured costs
    # and the model's makespans are in the same seconds. None: real servers, 1.
    time_scale: float | None = Field(default=None, gt=0, le=10000)

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def canonical(self) -> dict[str, Any]:
        """The inventory as stored: defaults filled in, so equal inventories compare equal."""
        return self.model_dump(mode="json", exclude_none=True)

    def digest(self) -> str:
        """sha256 of the canonical form: a re-import of the same inventory is recognised by it."""
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()




def parse_inventory(raw: Any, source: str = "inventory") -> Inventory:
    """Validate a parsed inventory document; BadInput names the first offending fields."""
    if not isinstance(raw, dict):
        raise BadInput(f"{source}: an inventory is a mapping with model, gpu, tp and nodes")
    try:
        inventory = Inventory.model_validate(raw)
    except ValidationError as exc:
        message, field = format_validation(exc)
        raise BadInput(f"{source}: {message}", field=field) from None
    seen: dict[str, int] = {}
    for i, node in enumerate(inventory.nodes):
        if node.name in seen:
            raise BadInput(
                f"{source}: nodes.{i}.name: duplicate node name {node.name!r} (also nodes.{seen[node.name]})",
                field=f"nodes.{i}.name")
        seen[node.name] = i
        if node.gpus % inventory.tp:
            raise BadInput(
                f"{source}: nodes.{i}.gpus: {node.gpus} GPUs on {node.name!r} is not a multiple of tp ({inventory.tp})",
                field=f"nodes.{i}.gpus")
    if inventory.total_gpus > MAX_TOTAL_GPUS:
        raise BadInput(f"{source}: nodes: {inventory.total_gpus:,} GPUs in all, above the sanity limit of "
                       f"{MAX_TOTAL_GPUS:,}", field="nodes")
    catalog = default_catalog()
    for key in ("model", "gpu"):
        try:
            getattr(catalog, key)(getattr(inventory, key))
        except BadInput as exc:
            raise BadInput(f"{source}: {exc}", field=key) from None
    return inventory


def load_inventory(path: str | Path) -> Inventory:
    """Read and validate an inventory YAML file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"{path}: cannot read the inventory: {exc.strerror}", field="FILE") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not a YAML text file (not UTF-8: {exc.reason} at byte {exc.start})",
                       field="FILE") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML: {exc}", field="FILE") from None
    return parse_inventory(raw, str(path))
