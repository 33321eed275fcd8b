"""`pearlctl init`, `cluster import` and `status` in process (the `pearlctl` fixture) against a real
database; `status --watch` and the console script in a process of their own."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from plan_support import PEARLCTL, REPO
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

pytestmark = pytest.mark.integration

PAPER = REPO / "sim" / "inventories" / "paper-32-h800.yaml"
SMALL = REPO / "sim" / "inventories" / "small.yaml"


def counts(database_url: str) -> tuple[int, int, int]:
    """(nodes, gpus, state_version): what an import wrote."""
    engine = create_engine(database_url, poolclass=NullPool)
    with engine.connect() as conn:
        row = conn.execute(text("SELECT (SELECT count(*) FROM nodes), (SELECT count(*) FROM gpus), "
                                "(SELECT pearl_state_version())")).one()
    engine.dispose()
    return tuple(row)


def test_import_paper_cluster_and_status_json(pearlctl, database_url: str) -> None:
    assert pearlctl("init").returncode == 0
    imported = pearlctl("cluster", "import", str(PAPER), "--json")
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout) == {"outcome": "created", "nodes": 5, "gpus": 32, "workers": 16,
                                           "state_version": 48}
    shown = pearlctl("status", "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)  # one JSON object and nothing else on stdout
    assert status["gpus"] == {
        "total": 32,
        "by_zone": {"preemptible": 12, "rollout": 4, "training": 16},
        "by_state": {"free": 20, "unavailable": 12},
        "by_zone_state": {"preemptible": {"unavailable": 12}, "rollout": {"free": 4}, "training": {"free": 16}},
    }
    assert status["state_version"] == 48 and status["plan"] is None and status["leases"] == []
    workers = status["workers"]
    assert len(workers) == 16
    assert {k: workers[0][k] for k in ("id", "node", "gpus", "role", "activity", "zone", "weights_version")} == {
        "id": 1, "node": "train-0", "gpus": [1, 2], "role": "training", "activity": "inactive", "zone": "overlap",
        "weights_version": 0}
    assert [(w["node"], w["zone"], w["role"]) for w in workers if w["node"] == "spot-1"] == [
        ("spot-1", "dedicated", "colocated")] * 2


def test_reimport_is_a_no_op_and_a_different_inventory_needs_replace(pearlctl, database_url: str,
                                                                     tmp_path: Path) -> None:
    assert pearlctl("init").returncode == 0
    assert pearlctl("cluster", "import", str(PAPER)).returncode == 0
    before = counts(database_url)
    # the same inventory, written differently (key order, flow style), is the same inventory
    same = tmp_path / "same.yaml"
    raw = yaml.safe_load(PAPER.read_text())
    same.write_text(yaml.safe_dump({"nodes": raw["nodes"], "tp": 2, "gpu": "h800", "model": "qwen3-8b"}))
    again = pearlctl("cluster", "import", str(same), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["outcome"] == "unchanged"
    assert counts(database_url) == before

    refused = pearlctl("cluster", "import", str(SMALL))
    assert refused.returncode == 2
    assert "already holds a different inventory" in refused.stderr and "--replace" in refused.stderr
    assert counts(database_url) == before

    replaced = pearlctl("cluster", "import", str(SMALL), "--replace", "--json")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout)["outcome"] == "replaced"
    nodes, gpus, _ = counts(database_url)
    assert (nodes, gpus) == (3, 8)
    status = json.loads(pearlctl("status", "--json").stdout)
    assert status["cluster"]["model"] == "qwen3-4b" and status["cluster"]["tp"] == 1


def test_replace_is_refused_while_a_worker_serves(pearlctl, database_url: str) -> None:
    assert pearlctl("init").returncode == 0
    assert pearlctl("cluster", "import", str(SMALL)).returncode == 0
    engine = create_engine(database_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("UPDATE gpus SET state = 'bound', worker_id = slot_id WHERE zone = 'rollout' "
                          "AND device_index = 0"))
        conn.execute(text("UPDATE workers SET activity = 'transitioning', role = 'decode' WHERE id = "
                          "(SELECT slot_id FROM gpus WHERE zone = 'rollout' AND device_index = 0)"))
    engine.dispose()
    before = counts(database_url)
    refused = pearlctl("cluster", "import", str(PAPER), "--replace")
    assert refused.returncode == 1
    assert "1 worker(s) not inactive, 1 GPU(s) in use (not free, unavailable, lost or revoked)" in refused.stderr
    assert counts(database_url) == before


def test_lost_and_revoked_gpus_do_not_block_a_replace(pearlctl, database_url: str) -> None:
    assert pearlctl("init").returncode == 0
    assert pearlctl("cluster", "import", str(SMALL)).returncode == 0
    engine = create_engine(database_url, poolclass=NullPool)
    with engine.begin() as conn:  # one rollout GPU failed; one granted preemptible GPU was taken back
        conn.execute(text("UPDATE gpus SET state = 'lost' "
                          "WHERE id = (SELECT min(id) FROM gpus WHERE zone = 'rollout')"))
        spot = conn.execute(text("SELECT min(id) FROM gpus WHERE zone = 'preemptible'")).scalar_one()
        conn.execute(text("UPDATE gpus SET state = 'free' WHERE id = :g"), {"g": spot})
        conn.execute(text("UPDATE gpus SET state = 'revoked' WHERE id = :g"), {"g": spot})
    engine.dispose()
    replaced = pearlctl("cluster", "import", str(PAPER), "--replace", "--json")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout)["outcome"] == "replaced"


BAD_INVENTORIES = [
    ("malformed YAML", "model: qwen3-8b\nnodes: [\n", "not valid YAML"),
    ("unknown key", {"colour": "blue"}, "colour: Extra inputs are not permitted"),
    ("unknown node key", {"nodes": [{"name": "a", "zone": "rollout", "gpus": 2, "address": "x", "rack": 3}]},
     "nodes.0.rack: Extra inputs are not permitted"),
    ("duplicate node names", {"nodes": [{"name": "a", "zone": "rollout", "gpus": 2, "address": "x"},
                                        {"name": "a", "zone": "training", "gpus": 2, "address": "y"}]},
     "nodes.1.name: duplicate node name 'a' (also nodes.0)"),
    ("gpus not divisible by tp", {"nodes": [{"name": "a", "zone": "rollout", "gpus": 3, "address": "x"}]},
     "nodes.0.gpus: 3 GPUs on 'a' is not a multiple of tp (2)"),
    ("unknown zone", {"nodes": [{"name": "a", "zone": "spot", "gpus": 2, "address": "x"}]},
     "nodes.0.zone: Input should be 'training', 'rollout' or 'preemptible'"),
    ("unknown model", {"model": "llama-9000"}, "model: unknown model 'llama-9000'"),
    ("unknown GPU", {"gpu": "k80"}, "gpu: unknown GPU 'k80'"),
    ("tp zero", {"tp": 0}, "tp: Input should be greater than 0"),
    ("missing nodes", {"nodes": None}, "nodes: Input should be a valid tuple"),
]


@pytest.mark.parametrize(("case", "change", "message"), BAD_INVENTORIES, ids=[c[0] for c in BAD_INVENTORIES])
def test_bad_inventory_is_refused_naming_the_field(database_url: str, pearlctl_env: dict[str, str], tmp_path: Path,
                                                   case: str, change: str | dict, message: str) -> None:
    # In-process (the same Typer app the console script runs) to keep the suite fast; the exit code
    # through a real process is checked by test_bad_inventory_exit_code_through_the_console_script.
    from pearl.cli.app import app
    from typer.testing import CliRunner

    path = tmp_path / "bad.yaml"
    if isinstance(change, str):
        path.write_text(change)
    else:
        raw = {"model": "qwen3-8b", "gpu": "h800", "tp": 2,
               "nodes": [{"name": "r", "zone": "rollout", "gpus": 2, "address": "x"}]}
        path.write_text(yaml.safe_dump({**raw, **change}))
    env = {"PEARL_HOME": pearlctl_env["PEARL_HOME"], "PEARL_DATABASE_URL": database_url}
    result = CliRunner().invoke(app, ["cluster", "import", str(path)], env=env)
    assert result.exit_code == 2, (case, result.stderr)
    assert message in " ".join(result.stderr.split()), result.stderr
    assert result.stdout == ""
    assert counts(database_url) == (0, 0, 0)  # nothing written


def test_bad_inventory_exit_code_through_the_console_script(pearlctl_process, database_url: str,
                                                            tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": "qwen3-8b", "gpu": "h800", "tp": 2,
                                    "nodes": [{"name": "t", "zone": "training", "gpus": 3, "address": "x"}]}))
    result = pearlctl_process("cluster", "import", str(path))
    assert result.returncode == 2
    assert "nodes.0.gpus: 3 GPUs on 't' is not a multiple of tp (2)" in result.stderr
    assert counts(database_url) == (0, 0, 0)


def test_missing_file_is_bad_input(pearlctl) -> None:
    result = pearlctl("cluster", "import", "/nonexistent/inventory.yaml")
    assert result.returncode == 2 and "cannot read the inventory" in result.stderr


def test_unreachable_database_names_the_url_without_its_password(pearlctl) -> None:
    url = "postgresql://pearl:s3cret-pw@127.0.0.1:1/pearl"
    for args in (("init",), ("status", "--json"), ("cluster", "import", str(SMALL))):
        result = pearlctl(*args, extra_env={"PEARL_DATABASE_URL": url})
        assert result.returncode == 1, result.stderr
        assert "cannot connect to postgresql://pearl@127.0.0.1:1/pearl" in result.stderr
        assert "s3cret-pw" not in result.stderr + result.stdout


def test_commands_before_init_say_what_to_run(pearlctl, empty_database_url: str) -> None:
    for args in (("status",), ("cluster", "import", str(SMALL))):
        result = pearlctl(*args, extra_env={"PEARL_DATABASE_URL": empty_database_url})
        assert result.returncode == 1
        assert "has no pearl schema: run `pearlctl init`" in result.stderr


def test_status_tables_and_watch(pearlctl, database_url: str, pearlctl_env: dict[str, str]) -> None:
    assert pearlctl("init").returncode == 0
    assert pearlctl("cluster", "import", str(PAPER)).returncode == 0
    table = pearlctl("status")
    assert table.returncode == 0
    assert "GPUs by zone and state" in table.stdout and "train-1" in table.stdout

    # --watch refreshes until interrupted: a change made while it runs shows in what it draws last
    env = {**pearlctl_env, "PEARL_DATABASE_URL": database_url}
    # SIGINT at its default: a test run started in the background inherits it ignored
    watch = subprocess.Popen([str(PEARLCTL), "status", "--watch", "--interval", "0.2"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    with watch:
        try:
            first = watch.stdout.readline()  # it is up and has drawn the fleet
            engine = create_engine(database_url, poolclass=NullPool)
            with engine.begin() as conn:
                conn.execute(text("UPDATE gpus SET state = 'lost' WHERE id = 1"))
            engine.dispose()
            second = watch.stdout.readline()  # the change, at the next refresh
            time.sleep(0.5)  # a few refreshes with nothing new: no line
            watch.send_signal(signal.SIGINT)
            rest, errors = watch.communicate(timeout=30)
        finally:
            if watch.poll() is None:  # it did not stop: end it, so no process or pipe outlives the test
                watch.kill()
                watch.communicate()
    assert watch.returncode == 0, errors
    # piped, it prints one plain line per change (a terminal gets the refreshing tables)
    out = first + second + rest
    lines = out.splitlines()
    assert len(lines) == 2 and "┃" not in out, out
    assert "state_version 48" in lines[0] and "20 free, 12 unavailable" in lines[0]
    assert "state_version 49" in lines[1] and "1 lost" in lines[1] and "latest plan: none" in lines[1]
