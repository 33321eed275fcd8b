"""A refused input writes nothing: fuzzed inventories, telemetry and the other events through `pearlctl
cluster import` and `pearlctl event ...` either go in (exit 0) or exit 2 naming the field, and after a
refusal a dump of every table is what it was."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import INVENTORY, mutated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pearl.cli.app import app
from plan_support import import_cluster, small_inventory, telemetry
from sqlalchemy import Engine, text
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

FUZZ = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def dump(engine: Engine) -> dict[str, list[tuple]]:
    with engine.connect() as conn:
        tables = conn.execute(text("SELECT table_name FROM information_schema.tables WHERE table_schema = "
                                   "'public' AND table_type = 'BASE TABLE' ORDER BY 1")).scalars().all()
        return {t: [tuple(r) for r in conn.execute(text(f'SELECT * FROM "{t}" ORDER BY 1'))] for t in tables}


def _refusal_writes_nothing(engine: Engine, url: str, tmp_path: Path, args: list[str], doc: Any) -> None:
    path = tmp_path / "input.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    before = dump(engine)
    res = CliRunner().invoke(app, [*args, str(path), "--json"], env={"PEARL_DATABASE_URL": url})
    assert res.exit_code in (0, 2), res.output
    if res.exit_code == 2:
        assert json.loads(res.output.splitlines()[0])["error"], res.output
        assert dump(engine) == before


@FUZZ
@given(doc=mutated(INVENTORY))
def test_a_refused_inventory_writes_nothing(db_engine: Engine, database_url: str, tmp_path: Path, doc: Any) -> None:
    _refusal_writes_nothing(db_engine, database_url, tmp_path, ["cluster", "import"], doc)


@FUZZ
@given(doc=st.data())
def test_refused_telemetry_writes_nothing(db_engine: Engine, database_url: str, tmp_path: Path, doc: Any) -> None:
    with db_engine.connect() as conn:
        imported = conn.execute(text("SELECT count(*) FROM nodes")).scalar()
    if not imported:
        import_cluster(db_engine, small_inventory())
    _refusal_writes_nothing(db_engine, database_url, tmp_path, ["event", "telemetry"], doc.draw(mutated(telemetry(0))))


# The other event commands, each option drawn from numbers in and out of range, floats with nan and
# inf, and text: every call goes in (exit 0) or exits 2, and a refusal leaves every table as it was.
_VALUE = st.one_of(st.integers(-3, 2**70).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.text(max_size=8), st.lists(st.integers(-2, 9), max_size=4).map(lambda d: ",".join(map(str, d))))
EVENT_OPTIONS = {
    "training-begin": ("--step",),
    "training-end": ("--step", "--weights-version", "--snapshot"),
    "rollout-progress": ("--step", "--finished", "--batch-size", "--in-flight"),
    "gpus-granted": ("--node", "--gpus"),
    "gpus-revoked": ("--node", "--gpus", "--notice-s"),
}


@pytest.mark.parametrize("command", sorted(EVENT_OPTIONS))
@FUZZ
@given(data=st.data())
def test_refused_events_write_nothing(db_engine: Engine, database_url: str, command: str, data: Any) -> None:
    with db_engine.connect() as conn:
        imported = conn.execute(text("SELECT count(*) FROM nodes")).scalar()
    if not imported:
        import_cluster(db_engine, small_inventory())
    args = ["event", command]
    for option in EVENT_OPTIONS[command]:
        if data.draw(st.booleans(), label=f"give {option}"):
            node = st.sampled_from(["spot-0", "roll-0", "train-0", "nope"])
            args += [option, data.draw(st.one_of(node, _VALUE) if option == "--node" else _VALUE, label=option)]
    if command == "training-begin":
        args += ["--wait", "0"]
    before = dump(db_engine)
    res = CliRunner().invoke(app, [*args, "--json"], env={"PEARL_DATABASE_URL": database_url})
    assert res.exception is None or isinstance(res.exception, SystemExit), (args, res.exception)
    assert res.exit_code in (0, 2), (args, res.output)
    if res.exit_code == 2:
        assert res.output.strip(), args
        assert dump(db_engine) == before, args
