"""The sglang driver: its command lines per role and TP size (tests/conformance parses them with SGLang's
own argument parser), run against a stand-in for `python -m sglang.launch_server`
(tests/standin: parses the same flags, then becomes the simulated server). A `gpu` test launches a
real SGLang server where sglang and CUDA are installed."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from pearl.agents.drivers.base import DriverError, ServerSpec, WeightsRef
from pearl.agents.drivers.sglang import SglangDriver
from pearl.agents.server_client import ServerClient
from pearl.controlplane.core.domain import Role
from workers_support import wait_gone

STANDIN = Path(__file__).resolve().parents[1] / "standin"


def sg_spec(worker: int, role: Role, tp: int = 1, overlap: bool = False, weights=None) -> ServerSpec:
    devices = tuple(range(worker * tp, worker * tp + tp))
    return ServerSpec(worker, "node-a", "127.0.0.1", role, devices, tp, "qwen3-8b", "h100", 1, 1, overlap, weights)


def flags(argv: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


@pytest.mark.unit
@pytest.mark.parametrize(("role", "tp", "overlap"), [(Role.COLOCATED, 1, False), (Role.PREFILL, 2, False),
                                                      (Role.DECODE, 4, True), (Role.COLOCATED, 8, True)])
def test_command_lines_per_role_and_tp(tmp_path, role, tp, overlap):
    driver = SglangDriver(tmp_path, transfer_backend="mooncake", extra_args=("--disaggregation-ib-device", "mlx5_0"))
    spec = sg_spec(1, role, tp, overlap, WeightsRef(7, "/ckpt/step-7"))
    argv, env = driver.command(spec, 31000, 32000 if role is not Role.COLOCATED else None)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    f = flags(argv)
    assert f["--model-path"] == "/ckpt/step-7" and f["--served-model-name"] == "qwen3-8b"
    assert f["--tp-size"] == str(tp) and f["--port"] == "31000" and f["--weight-version"] == "7"
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(str(d) for d in range(tp, 2 * tp))
    assert len({f["--port"], f["--nccl-port"], f["--engine-info-bootstrap-port"]}) == 3
    if role is Role.COLOCATED:
        assert "--disaggregation-mode" not in f and "--enable-pd-role-switch" not in f
    else:
        assert f["--disaggregation-mode"] == role.value and f["--disaggregation-bootstrap-port"] == "32000"
        assert f["--disaggregation-transfer-backend"] == "mooncake" and f["--enable-pd-role-switch"] is True
    assert ("--enable-memory-saver" in f) == ("--enable-weights-cpu-backup" in f) == overlap
    assert f["--disaggregation-ib-device"] == "mlx5_0"


@pytest.mark.unit
def test_a_server_needs_a_model_sglang_can_load(tmp_path):
    """Before any snapshot: the driver's model path (the catalog's name is not a model SGLang can load);
    a snapshot folder without the model's config is refused before the launch."""
    with pytest.raises(DriverError, match=r"no weight snapshot is registered.*--model-path"):
        SglangDriver(tmp_path).command(sg_spec(0, Role.COLOCATED), 1, None)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"")
    with pytest.raises(DriverError, match="has no config.json"):
        SglangDriver(tmp_path).command(sg_spec(0, Role.COLOCATED, weights=WeightsRef(2, str(bare))), 1, None)
    (bare / "config.json").write_text("{}")
    argv, _ = SglangDriver(tmp_path).command(sg_spec(0, Role.COLOCATED, weights=WeightsRef(2, str(bare))), 1, None)
    assert argv[argv.index("--model-path") + 1] == str(bare)


@pytest.mark.unit
def test_a_worker_needs_as_many_devices_as_its_tp(tmp_path):
    bad = ServerSpec(1, "n", "127.0.0.1", Role.DECODE, (0,), 2, "qwen3-8b", "h100", 1, 1, False)
    with pytest.raises(DriverError, match="tp 2 needs as many devices"):
        SglangDriver(tmp_path).command(bad, 1, 2)
    with pytest.raises(DriverError, match="no server for role training"):
        SglangDriver(tmp_path).launch(sg_spec(1, Role.TRAINING))


@pytest.fixture
def standin_driver(tmp_path):
    path = os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    driver = SglangDriver(tmp_path / "node", env={"PYTHONPATH": path, "PEARL_STANDIN_SPEED": "25"},
                          model_path="Qwen/Qwen3-8B")
    yield driver
    for server in driver.servers():
        driver.stop(server.worker_id, grace_s=5)


@pytest.mark.e2e
def test_launch_flip_and_stop_against_the_standin(standin_driver):
    prefill = standin_driver.launch(sg_spec(0, Role.PREFILL))
    decode = standin_driver.launch(sg_spec(1, Role.DECODE, overlap=True))
    for s in (prefill, decode):
        standin_driver.wait_ready(s, 60)
    assert prefill.bootstrap_port and decode.bootstrap_port and prefill.bootstrap_port != decode.bootstrap_port
    assert prefill.endpoint != decode.endpoint
    client = ServerClient(prefill.endpoint, fence=2)
    assert client.model_info()["disaggregation_mode"] == "prefill"
    assert client.server_info()["disaggregation_bootstrap_port"] == prefill.bootstrap_port
    client.pd_role_switch("decode", decode_cuda_graph_memory_gb=2.0)
    assert client.model_info()["disaggregation_mode"] == "decode"
    ServerClient(decode.endpoint, fence=1).release_memory_occupation()  # launched with the memory saver
    pids = [prefill.pid, decode.pid]
    assert standin_driver.stop(0, grace_s=5) and standin_driver.stop(1, grace_s=5)
    assert wait_gone(pids) and standin_driver.servers() == []


@pytest.mark.e2e
def test_a_refused_command_line_is_reported_with_its_log(standin_driver):
    standin_driver.extra_args = ("--no-such-flag",)
    server = standin_driver.launch(sg_spec(0, Role.COLOCATED))
    with pytest.raises(DriverError, match=r"exited before it was ready(.|\n)*unrecognized arguments: --no-such-flag"):
        standin_driver.wait_ready(server, 60)


@pytest.mark.gpu
@pytest.mark.e2e
def test_a_real_sglang_server_starts_and_flips(tmp_path):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = os.environ.get("PEARL_TEST_SGLANG_MODEL")
    if not model:
        pytest.skip("PEARL_TEST_SGLANG_MODEL (a local model directory) is not set")
    driver = SglangDriver(tmp_path, transfer_backend="mooncake", extra_args=("--load-format", "dummy"))
    spec = ServerSpec(0, "local", "127.0.0.1", Role.PREFILL, (0,), 1, model, "h100", 1, 1, False)
    server = driver.launch(spec)
    try:
        driver.wait_ready(server, 900)
        client = ServerClient(server.endpoint, timeout_s=120)
        assert client.model_info()["disaggregation_mode"] == "prefill"
        client.pd_role_switch("decode", decode_cuda_graph_memory_gb=0.0)
        assert client.model_info()["disaggregation_mode"] == "decode"
    finally:
        assert driver.stop(0, grace_s=60)
