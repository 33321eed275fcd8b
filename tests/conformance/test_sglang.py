"""pearl against SGLang's own code (the version the `sglang` extra pins, installed without its GPU
dependencies: README's test command does it, and CI fails here rather than skip when it is missing).

- every command line the `sglang` driver builds is parsed by SGLang's `prepare_server_args`, in a
  subprocess (tests/conformance/parse_server_args.py), and says what pearl meant;
- every request pearl sends to a server (the agent's client, the sync group, the trainer's generate
  turns) goes to an endpoint SGLang's HTTP server declares, with a method it allows, and its body
  validates against SGLang's request type with no field SGLang would ignore
  (tests/conformance/sglang_source.py reads both from SGLang's installed source);
- each mismatch this once had is refused when put back.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from pearl.agents.drivers.base import ServerSpec, WeightsRef
from pearl.agents.drivers.sglang import SglangDriver
from pearl.agents.server_client import ServerClient
from pearl.agents.trainer import generate_body
from pearl.controlplane.core.domain import Role

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sglang_source  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def sglang_installed() -> None:
    version = sglang_source.installed_version()
    if version == sglang_source.SGLANG_VERSION and sglang_source.sglang_root() is not None:
        return
    why = (f"SGLang {sglang_source.SGLANG_VERSION} is not installed (found {version}): "
           f"pip install --no-deps 'sglang=={sglang_source.SGLANG_VERSION}'")
    if os.environ.get("PEARL_REQUIRE_SGLANG"):
        pytest.fail(why)
    pytest.skip(why)


def parse(argvs: list[list[str]]) -> list[dict[str, Any]]:
    """SGLang's verdict on each command line (what follows `-m sglang.launch_server`)."""
    env = dict(os.environ)
    if importlib.util.find_spec("triton") is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "placeholders"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(HERE / "parse_server_args.py")], input=json.dumps(argvs),
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def spec_of(worker: int, role: Role, tp: int, overlap: bool, weights: WeightsRef | None) -> ServerSpec:
    devices = tuple(range(worker * tp, worker * tp + tp))
    return ServerSpec(worker, "node-a", "127.0.0.1", role, devices, tp, "qwen3-8b", "h100", 1, 1, overlap, weights)


CASES = [(role, tp, overlap, weights) for role in (Role.COLOCATED, Role.PREFILL, Role.DECODE)
         for tp, overlap, weights in ((1, False, None), (2, True, WeightsRef(7, "/ckpt/step-7")),
                                      (8, False, WeightsRef(3, "/ckpt/step-3")))]


def test_every_command_line_the_driver_builds_parses_with_sglangs_own_parser(tmp_path: Path) -> None:
    driver = SglangDriver(tmp_path, transfer_backend="mooncake", model_path="Qwen/Qwen3-8B", ib_device="mlx5_0",
                          extra_args=("--mem-fraction-static", "0.8"))
    built = []
    for i, (role, tp, overlap, weights) in enumerate(CASES):
        argv, _ = driver.command(spec_of(i, role, tp, overlap, weights), 31000 + i, 32000 + i)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        built.append(argv[3:])
    for (role, tp, overlap, weights), argv, verdict in zip(CASES, built, parse(built), strict=True):
        assert verdict["ok"], (argv, verdict["error"])
        args = verdict["args"]
        assert args["model_path"] == (weights.uri if weights else "Qwen/Qwen3-8B")
        assert args["served_model_name"] == "qwen3-8b" and args["tp_size"] == tp and args["host"] == "127.0.0.1"
        assert args["weight_version"] == (str(weights.version) if weights else "default")
        assert args["enable_memory_saver"] is overlap and args["enable_weights_cpu_backup"] is overlap
        assert args["mem_fraction_static"] == 0.8
        if role is Role.COLOCATED:
            assert args["disaggregation_mode"] == "null" and args["enable_pd_role_switch"] is False
        else:
            assert args["disaggregation_mode"] == role.value and args["enable_pd_role_switch"] is True
            assert args["disaggregation_transfer_backend"] == "mooncake"
            assert args["disaggregation_ib_device"] == "mlx5_0"
            assert args["disaggregation_bootstrap_port"] == int(argv[argv.index("--disaggregation-bootstrap-port") + 1])


def test_every_transfer_backend_the_agent_offers_is_one_sglang_knows(tmp_path: Path) -> None:
    from pearl.cli.agent import TRANSFER_BACKENDS

    argvs = []
    for backend in TRANSFER_BACKENDS:
        driver = SglangDriver(tmp_path, transfer_backend=backend, model_path="m")
        argvs.append(driver.command(spec_of(0, Role.PREFILL, 1, False, None), 31000, 32000)[0][3:])
    verdicts = parse(argvs)
    assert all(v["ok"] for v in verdicts), [v.get("error") for v in verdicts]
    assert [v["args"]["disaggregation_transfer_backend"] for v in verdicts] == list(TRANSFER_BACKENDS)


def test_sglangs_parser_refuses_what_it_does_not_know() -> None:
    """The check is SGLang's own: an unknown flag, a value outside its choices."""
    bad = parse([["--model-path", "m", "--no-such-flag"],
                 ["--model-path", "m", "--disaggregation-mode", "both"],
                 ["--model-path", "m", "--tp-size", "two"]])
    assert not any(v["ok"] for v in bad)
    assert "unrecognized arguments: --no-such-flag" in bad[0]["error"]
    assert "invalid choice: 'both'" in bad[1]["error"]
    assert "invalid int value: 'two'" in bad[2]["error"]


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request as a server that took it, and records it."""

    seen: list[tuple[str, str, dict[str, str], Any]]

    def _answer(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.server.seen.append((self.command, url.path, dict(parse_qsl(url.query)), body))  # type: ignore[attr-defined]
        if url.path == "/v1/loads":
            out: Any = {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}
        elif url.path == "/model_info":
            out = {"weight_version": "5", "disaggregation_mode": "decode"}
        else:
            out = {"success": True, "message": "ok"}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_every_request_of_the_agents_client_is_one_sglang_takes(recorder: ThreadingHTTPServer) -> None:
    host, port = recorder.server_address[:2]
    client = ServerClient(f"http://{host}:{port}", fence=3)
    client.health()
    client.ready()
    client.server_info()
    client.model_info()
    client.is_idle()
    client.graph_memory_gb()
    for mode in ("abort", "retract", "in_place"):
        client.pause_generation(mode)
    client.continue_generation()
    client.release_memory_occupation()
    client.resume_memory_occupation(("weights",))
    client.pd_role_switch("decode")
    client.pd_role_switch("decode", decode_cuda_graph_memory_gb=1.5, decode_cuda_graph_bs=[1, 8, 32])
    client.update_weights_from_disk("/ckpt/step-7", weight_version=7)
    client.flush_cache()
    client.close()
    seen = recorder.seen  # type: ignore[attr-defined]
    assert {path for _, path, _, _ in seen} == {
        "/health", "/ready", "/server_info", "/model_info", "/v1/loads", "/pause_generation", "/continue_generation",
        "/release_memory_occupation", "/resume_memory_occupation", "/pd_role_switch", "/update_weights_from_disk",
        "/flush_cache"}
    problems = [p for method, path, query, body in seen for p in sglang_source.problems(method, path, query, body)]
    assert problems == []


def test_every_request_of_the_sync_group_is_one_sglang_takes() -> None:
    torch = pytest.importorskip("torch")
    from pearl.controlplane.weights.broadcast import SyncGroup, layout

    group = SyncGroup({1: "http://a:1", 2: "http://b:1"}, host="10.0.0.1", port=29500, tp={2: 4})
    state = {"model.embed_tokens.weight": torch.ones(64, 32, dtype=torch.bfloat16),
             "model.norm.weight": torch.ones(32), "step": torch.tensor([1])}
    buckets = layout(state, bucket_bytes=4096)
    assert len(buckets) >= 2
    requests = [("/init_weights_update_group", group.init_body(w)) for w in (1, 2)]
    requests += [("/update_weights_from_distributed", group.bucket_body(b, 9, k == len(buckets) - 1))
                 for k, b in enumerate(buckets)]
    requests.append(("/destroy_weights_update_group", group.destroy_body()))
    problems = [p for path, body in requests for p in sglang_source.problems("POST", path, {}, body)]
    assert problems == []
    assert requests[-2][1]["weight_version"] == "9" and "weight_version" not in requests[2][1]


def test_the_simulated_server_guards_exactly_the_commands_sglang_guards_with_its_admin_key() -> None:
    """SGLang's admin API key protects its ADMIN_OPTIONAL endpoints; the simulated server protects the
    same ones among those it serves, and leaves reads and generation open as SGLang does."""
    from pearl.agents.simworker import ADMIN_PATHS

    served = {"/health", "/ready", "/server_info", "/model_info", "/v1/loads", "/generate", *ADMIN_PATHS}
    guarded = {path for path in served for r in sglang_source.routes().get(path, []) if r.auth == "admin_optional"}
    assert guarded == set(ADMIN_PATHS)


def test_the_admin_key_reaches_sglang_from_a_file_only_its_user_reads(tmp_path: Path) -> None:
    token = "t" * 64
    driver = SglangDriver(tmp_path, model_path="m", admin_api_key=token)
    argv, _ = driver.command(spec_of(0, Role.DECODE, 1, False, None), 31000, 32000)
    assert token not in " ".join(argv)
    config = Path(argv[argv.index("--config") + 1])
    assert config.stat().st_mode & 0o077 == 0
    (verdict,) = parse([argv[3:]])
    assert verdict["ok"], verdict.get("error")
    assert verdict["args"]["admin_api_key"] == token and verdict["args"]["disaggregation_mode"] == "decode"


def test_the_trainers_generate_turn_is_one_sglang_takes() -> None:
    assert sglang_source.problems("POST", "/generate", {}, generate_body([1, 2, 3], 16, "t1-0")) == []


@pytest.mark.parametrize(("method", "path", "body", "expected"), [
    # pearl's broadcast before it spoke SGLang's protocol
    ("POST", "/update_weights_from_distributed", {"group_name": "g", "weight_version": "3", "layout": {}},
     ["names: Field required", "dtypes: Field required", "shapes: Field required", "no field 'layout'"]),
    ("POST", "/init_weights_update_group", {"master_address": "h", "master_port": 1, "world_size": 2},
     ["rank_offset: Field required"]),
    ("POST", "/pd_role_switch", {"new_role": "decoder"}, ["new_role: Input should be 'prefill', 'decode' or ''"]),
    ("POST", "/pd_role_switch", {"new_role": "decode", "graph_gb": 1.0}, ["no field 'graph_gb'"]),
    ("POST", "/pause_generation", {"mode": "drain"}, ["mode: Input should be 'abort', 'retract' or 'in_place'"]),
    ("POST", "/update_weights_from_disk", {"weight_version": "3"}, ["model_path: Field required"]),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}}, ["no field 'max_tokens'"]),
    ("GET", "/v1/loads", {"detail": "all"}, ["query parameter 'detail'"]),
    ("POST", "/pd_role_switch_now", {}, ["has no such endpoint"]),
    ("GET", "/pause_generation", None, ["allows only ['POST']"]),
])
def test_each_mismatch_is_refused_when_put_back(method: str, path: str, body: Any, expected: list[str]) -> None:
    query = body if method == "GET" and isinstance(body, dict) else {}
    problems = sglang_source.problems(method, path, query, None if query else body)
    for fragment in expected:
        assert any(fragment in p for p in problems), (fragment, problems)
