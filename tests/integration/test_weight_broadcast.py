"""The torch.distributed fast path (gloo on the CPU), in SGLang's protocol: the trainer's rank
broadcasts the tensors in flattened buckets to simulated servers that really receive them; the
trainer then compares each server's reported checksum with the registered one, and the snapshot path
brings whoever the broadcast did not reach."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pearl.agents.drivers.process import free_port
from pearl.controlplane.weights import publish_weights
from pearl.controlplane.weights.broadcast import SyncGroup, expected_checksum, layout
from sqlalchemy import Engine
from weights_support import LiveFleet, bring_up, sync_rows, wait_for

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration


def state_dict(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(512, 256, generator=gen).to(torch.bfloat16),
            "model.layers.0.mlp.weight": torch.randn(256, 256, generator=gen),
            "model.layers.0.mlp.bias": torch.randn(256, generator=gen).to(torch.float16),
            "lm_head.weight": torch.randn(512, 256, generator=gen).to(torch.bfloat16),
            "step": torch.tensor([seed], dtype=torch.int64)}


def info(endpoint: str) -> dict[str, object]:
    return httpx.get(endpoint + "/model_info", timeout=10).json()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[int, str]]:
    procs, endpoints = [], {}
    for worker in (1, 2):
        port = free_port()
        with (tmp_path / f"server-{worker}.log").open("wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "pearl.cli.simworker", "--port", str(port),
                                           "--worker-id", str(worker), "--speed", "50"],
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        endpoints[worker] = f"http://127.0.0.1:{port}"
    try:
        for e in endpoints.values():
            wait_for(lambda e=e: _answers(e), 30, f"{e} answers")
        yield endpoints
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(20)


def _answers(endpoint: str) -> bool:
    try:
        return httpx.get(endpoint + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_broadcast_in_buckets_reaches_every_member_checked_and_a_wrong_checksum_is_not_counted(
        servers: dict[int, str]) -> None:
    group = SyncGroup(servers, bucket_bytes=128 * 1024)  # several buckets
    group.setup()
    try:
        state = state_dict(3)
        buckets = layout(state, group.bucket_bytes)
        assert len(buckets) >= 3
        assert group.broadcast(state, 3) == {1: None, 2: None}
        for e in servers.values():
            assert info(e)["weight_version"] == "3" and info(e)["weights_checksum"] == expected_checksum(buckets)
        wrong = {"lm_head.weight": "0" * 64}  # the checksum the trainer registered does not match what arrives
        refused = group.broadcast(state_dict(4), 4, wrong)
        assert all("weights checksum" in (refused[w] or "") for w in (1, 2)), refused
        # the group still works: the next broadcast is counted again
        assert group.broadcast(state_dict(5), 5) == {1: None, 2: None}
    finally:
        group.close()


def test_buckets_are_aligned_as_sglang_requires_and_the_group_counts_every_tp_rank() -> None:
    mixed = {"a.bias": torch.ones(3, dtype=torch.bfloat16), "b.weight": torch.ones(5, dtype=torch.float32),
             "c.flag": torch.ones(1, dtype=torch.bool), "d.step": torch.ones(1, dtype=torch.int64)}
    (bucket,) = layout(mixed)
    offset = 0
    sizes = {"int64": 8, "float32": 4, "bfloat16": 2, "bool": 1}
    for dtype, shape in zip(bucket.dtypes, bucket.shapes, strict=True):
        assert offset % sizes[dtype] == 0, (bucket.names, bucket.dtypes)
        offset += sizes[dtype] * int(torch.tensor(shape).prod())
    assert bucket.dtypes == ["int64", "float32", "bfloat16", "bool"]
    group = SyncGroup({3: "http://a", 1: "http://b", 7: "http://c"}, tp={1: 2, 3: 4})
    assert group.world_size == 1 + 2 + 4 + 1
    assert group.rank_offsets() == {1: 1, 3: 3, 7: 7}
    assert group.init_body(7)["rank_offset"] == 7 and group.init_body(7)["world_size"] == 8


@pytest.fixture
def live(db_engine: Engine, database_url: str, broker_url: str, tmp_path: Path,
         pearlctl_env: dict[str, str]) -> Iterator[LiveFleet]:
    fleet = bring_up(db_engine, database_url, broker_url, tmp_path, pearlctl_env)
    try:
        yield fleet
    finally:
        fleet.stop()


def test_members_of_a_sync_group_get_the_version_by_broadcast_the_others_by_snapshot(live: LiveFleet) -> None:
    live.start_agent("node-a")
    live.start_worker("node-a")
    live.serve({1, 2})
    group = SyncGroup({1: live.endpoint(1)})
    group.setup()
    try:
        live.cp.training_begin(1, wait_s=0)
        how = publish_weights(state_dict(1), live.run_dir / "snapshots" / "v1", step=1, version=1, cp=live.cp,
                              group=group)
    finally:
        group.close()
    assert how == {1: "broadcast", 2: "snapshot"}
    live.wait_versions({1, 2}, 1)
    assert [(r["worker_id"], r["state"], r["method"]) for r in sync_rows(live.engine)] == [
        (1, "done", "broadcast"), (2, "done", "snapshot")]
    assert live.served(1)["checksum"] == live.served(2)["checksum"] is not None  # the same weights either way
