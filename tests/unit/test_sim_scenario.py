"""Scenario files: the trace path is relative to the scenario file, and a bad trace is refused naming
the key (exit 2, nothing on stdout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pearl.cli.app import app
from pearl.controlplane.errors import BadInput
from pearl.sim.scenario import SHIPPED_DIR, load_scenario
from typer.testing import CliRunner

pytestmark = pytest.mark.unit


def _layout(tmp_path: Path, trace: object | None) -> Path:
    """scenarios/s.yaml pointing at ../traces/t.json (written unless `trace` is None), as shipped."""
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "traces").mkdir()
    text = (SHIPPED_DIR / "scenarios" / "paper-qwen3-8b-seg2.yaml").read_text()
    assert "../traces/seg2-scarce-volatile.json" in text
    path = tmp_path / "scenarios" / "s.yaml"
    path.write_text(text.replace("../traces/seg2-scarce-volatile.json", "../traces/t.json"))
    if trace is not None:
        body = trace if isinstance(trace, str) else json.dumps(trace)
        (tmp_path / "traces" / "t.json").write_text(body)
    return path


def test_the_trace_path_is_relative_to_the_scenario_file(tmp_path, monkeypatch):
    path = _layout(tmp_path, {"metadata": {"gap_seconds": 30, "source": "test"}, "data": [2, 7, 12]})
    monkeypatch.chdir(tmp_path / "traces")  # ../traces/t.json from here is no such file
    sc = load_scenario(path)
    assert sc.trace_data is not None and sc.trace_data.data == (2, 7, 12) and sc.trace_data.gap_seconds == 30
    assert [sc.preemptible_gpus_at(t) for t in (0, 30, 60, 9999)] == [2, 6, 12, 12]  # whole tp=2 workers, last holds


@pytest.mark.parametrize(("trace", "needle"), [
    (None, "cluster.preemptible.trace: cannot read"),
    ("not json", "is not JSON"),
    ({"data": [4]}, "missing metadata"),
    ({"metadata": {}, "data": [4]}, "metadata.gap_seconds"),
    ({"metadata": {"gap_seconds": 0}, "data": [4]}, "metadata.gap_seconds"),
    ({"metadata": {"gap_seconds": 60}}, "data"),
    ({"metadata": {"gap_seconds": 60}, "data": []}, "data"),
    ({"metadata": {"gap_seconds": 60}, "data": [4, -2]}, "data.1"),
])
def test_a_bad_trace_is_refused_naming_the_key(tmp_path, trace, needle):
    path = _layout(tmp_path, trace)
    with pytest.raises(BadInput, match="cluster.preemptible.trace") as info:
        load_scenario(path)
    assert needle in str(info.value)
    res = CliRunner().invoke(app, ["sim", "run", "--scenario", str(path), "--policy", "roll", "--json"])
    assert res.exit_code == 2 and needle in res.stderr
    assert json.loads(res.stdout) == {"error": str(info.value), "field": "cluster.preemptible.trace", "exit": 2}


def test_an_unknown_key_in_the_file_is_named(tmp_path):
    path = _layout(tmp_path, {"metadata": {"gap_seconds": 60}, "data": [4]})
    path.write_text(path.read_text() + "\ncolour: red\n")
    with pytest.raises(BadInput, match="^colour: Extra inputs are not permitted"):
        load_scenario(path)
