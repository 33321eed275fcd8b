"""Fuzzing inputs: a valid document with one to three of its fields replaced by odd values, removed,
or joined by an unknown one (tests/unit/test_fuzz_inputs.py, tests/integration/test_fuzz_refusals.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
INVENTORY = yaml.safe_load((REPO / "sim" / "inventories" / "small.yaml").read_text())

ODD = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:4]):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: Any, doc: Any) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(ODD)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(ODD)
        else:
            parent.append(draw(ODD))
    return doc


