"""Every input pearl reads from a user, fuzzed: a valid document with one to three of its fields
replaced by odd values, removed, or joined by an unknown one either parses or is refused as BadInput
naming where (`source: field: why`), never another exception. (Inventories, telemetry, scenarios and
snapshot manifests; a refusal writes nothing: tests/integration/test_fuzz_refusals.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from fuzz_support import INVENTORY, REPO, mutated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pearl.controlplane.core.inventory import parse_inventory
from pearl.controlplane.core.telemetry import parse_telemetry
from pearl.controlplane.errors import BadInput
from pearl.controlplane.weights import check_snapshot, write_snapshot
from pearl.sim.scenario import parse_scenario
from plan_support import telemetry

pytestmark = pytest.mark.unit

SCENARIO = yaml.safe_load((REPO / "sim" / "scenarios" / "ablation-qwen3-8b-dedicated10.yaml").read_text())
TELEMETRY = telemetry(0)
# "source: field...: why" (a field may be named oddly), or a rule across fields: "field (value) must ..."
NAMED = re.compile(r"^(.+?: \S|[a-z_][\w.]* \()", re.DOTALL)

def _works_or_names_the_field(parse: Any, doc: Any) -> None:
    try:
        parse(doc)
    except BadInput as exc:
        assert NAMED.match(str(exc)), f"a refusal that names no field: {exc!r}"


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(mutated(INVENTORY))
def test_inventories(doc: Any) -> None:
    _works_or_names_the_field(parse_inventory, doc)


@FUZZ
@given(mutated(TELEMETRY))
def test_telemetry(doc: Any) -> None:
    _works_or_names_the_field(parse_telemetry, doc)


@FUZZ
@given(mutated(SCENARIO))
def test_scenarios(doc: Any) -> None:
    _works_or_names_the_field(parse_scenario, doc)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(manifest=st.data())
def test_snapshot_manifests(tmp_path: Path, manifest: Any) -> None:
    snap = tmp_path / "s"
    write_snapshot({"a": np.ones(4, dtype=np.float32), "b": np.zeros((2, 3), dtype=np.float16)}, snap)
    original = json.loads((snap / "manifest.json").read_text())
    (snap / "manifest.json").write_text(json.dumps(manifest.draw(mutated(original))))
    _works_or_names_the_field(lambda _: check_snapshot(str(snap)), None)
