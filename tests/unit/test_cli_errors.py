"""The command line meets bad input: exit 2 naming the field, a JSON object under `--json`, no
traceback, no markup eaten; the names and help the CLI keeps beside the simulator. In process (no
database: every case is refused before one is needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from pearl.cli.app import app
from pearl.cli.common import handle_errors
from pearl.controlplane.errors import PearlError
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

INVENTORY = {"model": "qwen3-8b", "gpu": "h800", "tp": 2,
             "nodes": [{"name": "roll-0", "zone": "rollout", "gpus": 4, "address": "10.0.0.1"}]}


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def no_traceback(res) -> None:
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output


def test_a_failing_json_command_prints_one_error_object_on_stdout(tmp_path: Path) -> None:
    res = invoke("cluster", "import", str(tmp_path / "absent.yaml"), "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {"error": f"{tmp_path / 'absent.yaml'}: cannot read the inventory: "
                                               "No such file or directory", "field": "FILE", "exit": 2}
    bad = write(tmp_path / "bad.yaml", {**INVENTORY, "nodes": [{**INVENTORY["nodes"][0], "zone": "moon"}]})
    res = invoke("cluster", "import", str(bad), "--json")
    err = json.loads(res.stdout)
    assert res.exit_code == 2 and err["exit"] == 2 and err["field"] == "nodes.0.zone"
    assert "nodes.0.zone" in err["error"]


def test_usage_errors_under_json_are_json_too(monkeypatch, capsys) -> None:
    from pearl.cli import app as app_module

    monkeypatch.setattr("sys.argv", ["pearlctl", "sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--json"])
    with pytest.raises(SystemExit) as exited:
        app_module.main()
    assert exited.value.code == 2
    assert json.loads(capsys.readouterr().out) == {"error": "Missing option '--policy'.", "field": "--policy",
                                                   "exit": 2}
    res = invoke("status", "--json", "--watch")
    assert res.exit_code == 2 and json.loads(res.stdout)["field"] == "--watch"


def test_an_unexpected_error_is_one_line_not_a_traceback(monkeypatch, capsys) -> None:
    from pearl.cli import app as app_module

    def boom(*args, **kwargs):
        raise RuntimeError("the disk fell off")

    monkeypatch.setattr(app_module, "app", boom)
    monkeypatch.delenv("PEARL_DEBUG", raising=False)
    monkeypatch.setattr("sys.argv", ["pearlctl", "status", "--json"])
    with pytest.raises(SystemExit) as exited:
        app_module.main()
    captured = capsys.readouterr()
    assert exited.value.code == 1
    assert json.loads(captured.out)["error"].startswith("internal error: RuntimeError: the disk fell off")
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(("nodes", "field", "limit"), [
    ([{"name": "a", "zone": "rollout", "gpus": 1_000_000_000, "address": "x"}], "nodes.0.gpus", "1024"),
    ([{"name": f"n{i}", "zone": "rollout", "gpus": 1024, "address": "x"} for i in range(100)], "nodes", "100,000"),
])
def test_huge_inventories_are_refused_at_once_naming_the_field_and_the_limit(tmp_path, nodes, field, limit) -> None:
    res = invoke("cluster", "import", str(write(tmp_path / "huge.yaml", {**INVENTORY, "nodes": nodes})), "--json")
    assert res.exit_code == 2
    err = json.loads(res.stdout)
    assert err["field"] == field and limit in err["error"]


@pytest.mark.parametrize(("override", "field", "limit"), [
    ("workload.batch_size=100000000", "workload.batch_size", "65536"),
    ("duration_s=1e12", "duration_s", "604800"),
    ("cluster.training_gpus=100000000", "cluster.training_gpus", "4096"),
])
def test_huge_simulations_are_refused_naming_the_field_and_the_limit(override, field, limit) -> None:
    res = invoke("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "roll", "--set", override, "--json")
    assert res.exit_code == 2
    err = json.loads(res.stdout)
    assert err["field"] == field and limit in err["error"]
    no_traceback(res)


def test_non_utf8_files_are_bad_input_not_a_traceback(tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\xff\xfe\x00\x81 not text")
    for args in (["cluster", "import", str(blob)], ["event", "telemetry", str(blob)],
                 ["sim", "run", "--scenario", str(blob), "--policy", "roll"]):
        res = invoke(*args)
        no_traceback(res)
        assert res.exit_code == 2 and "not UTF-8" in res.stderr, args
        res = invoke(*args, "--json")
        assert json.loads(res.stdout)["exit"] == 2


def test_an_unusable_pearl_home_is_bad_input_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    env = {"PEARL_HOME": str(tmp_path / "file" / "home"), "PEARL_DATABASE_URL": "", "PEARL_BROKER_URL": ""}
    for args in (["init"], ["db", "url"], ["db", "start", "--json"]):
        res = invoke(*args, env=env)
        no_traceback(res)
        assert res.exit_code == 2, (args, res.output)
        assert "PEARL_HOME" in res.stderr
    assert json.loads(invoke("init", "--json", env=env).stdout)["field"] == "PEARL_HOME"


def test_brackets_in_messages_are_shown_as_they_are(tmp_path: Path) -> None:
    named = write(tmp_path / "inv[prod].yaml", {**INVENTORY, "tp": 3})
    res = invoke("cluster", "import", str(named))
    assert res.exit_code == 2 and "inv[prod].yaml" in res.stderr

    little = typer.Typer()

    @little.command()
    @handle_errors
    def needs_torch() -> None:
        raise PearlError("pip install -e '.[torch]'")

    res = CliRunner().invoke(little, [])
    assert res.exit_code == 1 and "pip install -e '.[torch]'" in res.stderr


def test_validation_messages_have_no_python_noise(tmp_path: Path) -> None:
    workload = {"batch_size": 6, "group_size": 4, "max_context_tokens": 4096,
                **{k: {"dist": "constant", "value": 1} for k in ("turns", "prompt_tokens", "obs_tokens_per_turn",
                                                                  "gen_tokens_per_turn", "env_latency_s")}}
    res = invoke("cluster", "import", str(write(tmp_path / "w.yaml", {**INVENTORY, "workload": workload})))
    assert res.exit_code == 2
    assert "workload: batch_size must be a multiple of group_size" in res.stderr
    assert "Value error" not in res.stderr
    res = invoke("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "roll",
                 "--set", "workload.turns.p99=0.5")
    assert res.exit_code == 2 and "workload.turns: p99 must be >= median" in res.stderr
    assert "Value error" not in res.stderr and "lognormal" not in res.stderr
    res = invoke("cluster", "import", str(write(tmp_path / "empty.yaml", {**INVENTORY, "nodes": []})))
    assert res.exit_code == 2 and "nodes: needs at least 1 entry, got 0" in res.stderr
    assert "Tuple" not in res.stderr


def test_sim_help_lists_the_systems_and_the_shipped_scenarios_and_explains_the_columns() -> None:
    from pearl.cli.sim import COLUMNS, SYSTEM_HELP
    from pearl.sim.systems import ABLATIONS, SYSTEMS

    assert list(SYSTEM_HELP) == [*SYSTEMS, *ABLATIONS]
    res = invoke("sim", "run", "--help", env={"COLUMNS": "400"})
    assert res.exit_code == 0
    text = " ".join(res.stdout.split())
    for name in SYSTEM_HELP:
        assert name in text
    assert "paper-qwen3-8b-seg1" in text
    for column in ("×rlb+", "GPU·h", "reconf", "late", "forced"):
        assert f"{column}: {COLUMNS[column]}" in text


def test_an_unknown_scenario_lists_the_shipped_ones() -> None:
    res = invoke("sim", "run", "--scenario", "paper-qwen9", "--policy", "roll")
    assert res.exit_code == 2
    assert "paper-qwen3-8b-seg1" in res.stderr and "prefill-heavy-qwen3-8b-dedicated16" in res.stderr


def test_reap_defaults_are_the_reapers() -> None:
    import inspect

    from pearl.cli.reap import reap
    from pearl.controlplane.store import reaper

    params = inspect.signature(reap).parameters
    assert params["max_attempts"].default == reaper.DEFAULT_MAX_ATTEMPTS
    assert params["agent_timeout"].default == reaper.DEFAULT_AGENT_TIMEOUT_S


def test_the_docs_explain_every_term_and_column_the_cli_prints() -> None:
    from pearl.cli.plan import TERMS
    from pearl.cli.sim import COLUMNS

    formats = (Path(__file__).resolve().parents[2] / "docs" / "formats").with_suffix(".md").read_text()
    for term, meaning in {**TERMS, **COLUMNS}.items():
        assert f"| `{term}` | {meaning} |" in formats, term
    text = " ".join(invoke("plan", "--help", env={"COLUMNS": "400"}).stdout.split())
    for term in ("R/B", "T_ded, T_full", "T_toggle", "dL", "predicted", "paper", "D_worker, D_role"):
        assert f"{term}: {TERMS[term]}" in text


def test_the_command_line_starts_without_the_database_and_simulator_libraries() -> None:
    """`pearlctl --help` and every command's registration import no SQLAlchemy, Alembic, psycopg,
    pydantic, numpy or simulator: each command imports what it uses when it runs (a fresh interpreter,
    since this one has them loaded already)."""
    import subprocess
    import sys

    heavy = ("sqlalchemy", "alembic", "psycopg", "pydantic", "numpy", "matplotlib", "pearl.sim", "pearl.policies")
    probe = "import sys, pearl.cli.app; print(sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[1:]))))"
    loaded = subprocess.run([sys.executable, "-c", probe, *heavy], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_the_schema_check_reads_the_head_revision_without_alembic() -> None:
    from pearl.controlplane.store.db import head_revision, head_revision_fast

    assert head_revision_fast() == head_revision()


def test_a_negative_seed_is_bad_input_not_an_internal_error() -> None:
    res = invoke("sim", "run", "--scenario", "paper-qwen3-8b-seg1", "--policy", "roll", "--set", "seed=-1", "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["field"] == "seed"


@pytest.mark.parametrize(("args", "named"), [
    (["apply", "99999999999999999999"], "plan_id"),
    (["apply", "--abort", "99999999999999999999"], "--abort"),
    (["event", "training-begin", "--step", "99999999999999999999"], "--step"),
    (["event", "rollout-progress", "--step", "1", "--finished", "99999999999999999999"], "--finished"),
    (["event", "gpus-granted", "--node", "spot-0", "--gpus", "99999999999999999999"], "--gpus"),
])
def test_numbers_beyond_the_database_are_bad_input_naming_the_option(args, named) -> None:
    res = invoke(*args)  # refused before any database is reached
    no_traceback(res)
    assert res.exit_code == 2 and named in res.stderr


def test_telemetry_beyond_the_limits_is_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"step": 99999999999999999999, "batch_size": 8, "trajectories": [{"turns": 1, '
                    '"prompt_tokens": 10, "obs_tokens": [], "gen_tokens": [5], "env_s": []}]}')
    res = invoke("event", "telemetry", str(path), "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["field"] == "step"


@pytest.mark.parametrize(("args", "field"), [
    (("--role", "training"), "--role"),
    (("--role", "prefill"), "--bootstrap-port"),
    (("--speed", "0"), "--speed"),
    (("--capacity", "0"), "--capacity"),
    (("--launched-at", "-1"), "--launched-at"),
    (("--launched-at", "9e12"), "--launched-at"),
])
def test_a_simulated_server_refuses_bad_options_before_it_serves(args, field) -> None:
    res = invoke("simworker", "--port", "1", *args)
    assert res.exit_code == 2, res.output
    assert field in res.output
    no_traceback(res)


@pytest.mark.parametrize(("args", "field"), [
    (("--speed", "0"), "--speed"),
    (("--duration", "-5"), "--duration"),
    (("--steps", "0"), "--steps"),
    (("--plot", "timeline.svg"), "--plot"),
])
def test_the_demo_refuses_bad_options_before_it_starts_anything(tmp_path: Path, monkeypatch, args, field) -> None:
    monkeypatch.setenv("PEARL_HOME", str(tmp_path / "home"))
    res = invoke("demo", "--json", *args)
    assert res.exit_code == 2, res.output
    assert json.loads(res.stdout)["field"] == field
    assert not (tmp_path / "home").exists()  # nothing started, nothing written
    no_traceback(res)


def test_an_agent_with_a_transfer_backend_sglang_does_not_know_is_refused_before_it_connects() -> None:
    res = invoke("agent", "--node", "node-a", "--driver", "sglang", "--transfer-backend", "tcp",
                 env={"PEARL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"})
    assert res.exit_code == 2 and "--transfer-backend: one of mooncake" in res.output


@pytest.mark.parametrize("command", ["agent", "worker"])
def test_a_node_name_that_is_not_one_is_refused_before_anything_is_made(tmp_path: Path, command: str) -> None:
    home = tmp_path / "home"
    res = invoke(command, "--node", "../../../x",
                 env={"PEARL_HOME": str(home), "PEARL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"})
    assert res.exit_code == 2 and "--node: a node name" in res.output
    assert not (tmp_path / "x").exists() and not home.exists()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("name", "../../../x", "nodes.0.name: String should match pattern"),
    ("name", "a/b", "nodes.0.name: String should match pattern"),
    ("address", "127.0.0.1:1/evil?", "nodes.0.address: a host name or an IP address"),
    ("address", "http://10.0.0.1", "nodes.0.address: a host name or an IP address"),
])
def test_an_inventory_node_name_or_address_that_is_not_one_is_refused(tmp_path: Path, field: str, value: str,
                                                                       message: str) -> None:
    node = {**INVENTORY["nodes"][0], field: value}
    res = invoke("cluster", "import", str(write(tmp_path / "bad.yaml", {**INVENTORY, "nodes": [node]})), "--json")
    assert res.exit_code == 2 and message in res.output


@pytest.mark.parametrize(("args", "message"), [
    (["--host", "0.0.0.0"], "--advertise-url: required when binding '0.0.0.0'"),
    (["--admin-host", "::"], "--advertise-admin-url: required when binding '::'"),
    (["--host", "0.0.0.0", "--advertise-url", "http://0.0.0.0:30000"], "--advertise-url: an http(s)://HOST"),
    (["--advertise-url", "http://gpu-0:30000/x?y"], "--advertise-url: an http(s)://HOST"),
    (["--port", "30000", "--admin-port", "30000"], "--admin-port: a TCP port (0-65535) other than --port"),
])
def test_a_front_door_that_would_record_an_address_no_node_can_reach_is_refused(args: list[str],
                                                                               message: str) -> None:
    res = invoke("router", "serve", "--no-register", *args)
    assert res.exit_code == 2 and message in res.output
