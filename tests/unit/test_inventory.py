"""Inventory validation and canonical form (pure; the import itself is tested against PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pearl.controlplane.core.domain import NodeZone
from pearl.controlplane.core.inventory import load_inventory, parse_inventory
from pearl.controlplane.errors import BadInput

pytestmark = pytest.mark.unit

SHIPPED = Path(__file__).resolve().parents[2] / "sim" / "inventories"
BASE = {"model": "qwen3-8b", "gpu": "h800", "tp": 2,
        "nodes": [{"name": "t", "zone": "training", "gpus": 4, "address": "h"}]}


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_inventories_load(path: Path) -> None:
    inventory = load_inventory(path)
    assert inventory.total_gpus == sum(n.gpus for n in inventory.nodes) > 0


def test_paper_inventory_shape() -> None:
    inventory = load_inventory(SHIPPED / "paper-32-h800.yaml")
    by_zone = {z: sum(n.gpus for n in inventory.nodes if n.zone is z) for z in NodeZone}
    assert by_zone == {NodeZone.TRAINING: 16, NodeZone.ROLLOUT: 4, NodeZone.PREEMPTIBLE: 12}


def test_digest_ignores_layout_but_not_content() -> None:
    same = parse_inventory({"nodes": BASE["nodes"], "tp": 2, "gpu": "h800", "model": "qwen3-8b"})
    assert same.digest() == parse_inventory(BASE).digest()
    moved = parse_inventory({**BASE, "nodes": [{**BASE["nodes"][0], "address": "other"}]})
    assert moved.digest() != parse_inventory(BASE).digest()


def test_workload_block_is_the_scenario_workload() -> None:
    workload = {"batch_size": 8, "max_context_tokens": 4096, "turns": {"dist": "constant", "value": 2},
                "prompt_tokens": {"dist": "constant", "value": 100},
                "obs_tokens_per_turn": {"dist": "constant", "value": 10},
                "gen_tokens_per_turn": {"dist": "constant", "value": 20},
                "env_latency_s": {"dist": "constant", "value": 0.5}}
    assert parse_inventory({**BASE, "workload": workload}).workload.batch_size == 8
    with pytest.raises(BadInput, match=r"workload\.turns\.value: Input should be greater than or equal"):
        parse_inventory({**BASE, "workload": {**workload, "turns": {"dist": "constant", "value": -1}}})


def test_rollout_block_is_the_predictors_loop() -> None:
    """The RL loop's batching, as the predictor sees it; a bad key is refused naming it."""
    loop = {"batching": "async", "trajectories_per_slot": 2, "update_gap_s": 93, "update_pause_s": 2,
            "abort_on_update": True}
    rollout = parse_inventory({**BASE, "rollout": loop}).rollout.rollout()
    assert rollout.is_async and rollout.slots(64) == 32 and rollout.update_gap_s == 93 and rollout.staleness == 1
    assert parse_inventory(BASE).rollout is None
    with pytest.raises(BadInput, match=r"rollout\.batching"):
        parse_inventory({**BASE, "rollout": {**loop, "batching": "whenever"}})
    with pytest.raises(BadInput, match=r"rollout\.trajectories_per_slot"):
        parse_inventory({**BASE, "rollout": {**loop, "trajectories_per_slot": 0}})
    with pytest.raises(BadInput, match=r"rollout\.slots"):
        parse_inventory({**BASE, "rollout": {**loop, "slots": 3}})


@pytest.mark.parametrize(("raw", "message"), [
    ([1, 2], "an inventory is a mapping"),
    ({**BASE, "nodes": []}, "nodes: needs at least 1 entry, got 0"),
    ({**BASE, "nodes": [{**BASE["nodes"][0], "gpus": 0}]}, "nodes.0.gpus: Input should be greater than 0"),
    ({**BASE, "nodes": [{**BASE["nodes"][0], "name": ""}]}, "nodes.0.name: String should match pattern"),
    ({k: v for k, v in BASE.items() if k != "gpu"}, "gpu: Field required"),
])
def test_bad_inventories_name_the_field(raw: object, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        parse_inventory(raw)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="cannot read the inventory"):
        load_inventory(tmp_path / "missing.yaml")
