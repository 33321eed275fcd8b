"""Weight sync: snapshot load and broadcast throughput beside the raw operations, and the time from a
training step's end to every worker on the new version.

1. Throughput, for each size (100 MB and 1 GB of bf16 tensors; `--quick`: 16 MB), in one run:
   - `snapshot_load`: pearl's check of a snapshot (`controlplane/weights/files.py`, `load_snapshot`:
     reads every tensor and checks its BLAKE3 checksum against the manifest), beside a raw safetensors load
     of the same file (`safetensors.torch.load` of its bytes: every byte read, no checks; the
     `bench` extra), and their ratio (raw time / pearl time). Both read a
     file just written (the page cache is warm for both).
   - `broadcast`: pearl's bucketed broadcast (`controlplane/weights/broadcast.py`: pack the buckets,
     gloo broadcast of each flattened bucket as SGLang receives it, the simulated server's BLAKE3
     checksum of every received tensor), beside a raw
     `torch.distributed.broadcast` of the same tensors one by one (no packing, no checks), to one
     receiving process on this machine, and their ratio (raw time / pearl time).
2. Latency: the wall time from `training_end` (snapshot checked, registered, syncs queued and sent)
   to every serving worker's `weights_version` at the new version in PostgreSQL, with 4 and 16
   simulated servers (`--quick`: 2) started by real agents (sim driver) on two nodes, one
   `pearlctl worker` per node; on Redis (`--broker-url`, default the embedded Redis) and on RabbitMQ
   (`--amqp-url`, skipped without one). Each repeat is a new training step and version.

Prints one JSON object. `--database-url`: a maintenance database (default: an embedded server).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from db_support import REPO, BenchServer, machine

sys.path.insert(0, str(REPO / "tests"))
from pearl.controlplane.weights import write_snapshot  # noqa: E402
from pearl.controlplane.weights.broadcast import (  # noqa: E402
    ReceiveBuffers,
    join_group,
    layout,
    leave_group,
    packed,
    receive_bucket,
    send_packed,
    tensor_digests,
)
from pearl.controlplane.weights.files import load_snapshot  # noqa: E402

MB = 1024 * 1024


def state_dict(nbytes: int, tensor_mb: int = 16) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    per = max(1, min(nbytes, tensor_mb * MB) // 2)  # bf16: 2 bytes per element
    out, left, i = {}, nbytes, 0
    while left > 0:
        n = min(per, left // 2) or 1
        out[f"model.layers.{i}.weight"] = torch.randn(n, generator=gen).to(torch.bfloat16)
        left -= 2 * n
        i += 1
    return out


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / MB / seconds, 1)


def snapshot_load(state: dict[str, Any], nbytes: int, directory: Path, repeat: int) -> dict[str, Any]:
    from safetensors.torch import load

    path = directory / "snap"
    write_snapshot(state, path)
    pearl, raw = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        snap = load_snapshot(str(path))
        pearl.append(time.perf_counter() - t)
        assert snap.checked == len(state)
        t = time.perf_counter()
        loaded = load((path / "model.safetensors").read_bytes())  # every byte read (load_file maps lazily)
        raw.append(time.perf_counter() - t)
        assert len(loaded) == len(state)
        del loaded
    p, r = min(pearl), min(raw)
    return {"pearl_checked_mb_per_s": _rate(nbytes, p), "raw_safetensors_mb_per_s": _rate(nbytes, r),
            "pearl_s": round(p, 3), "raw_s": round(r, 3), "ratio_pearl_to_raw": round(r / p, 3)}


def _receiver(port: int, nbytes: int, repeat: int, names: list[tuple[str, int]],
              spec: list[tuple[list[str], list[str], list[list[int]]]], done: Any) -> None:
    import concurrent.futures

    import torch
    import torch.distributed as dist

    pg = join_group("127.0.0.1", port, 1, 2, timeout_s=300)
    buffers = ReceiveBuffers()
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for _ in range(repeat):
        with concurrent.futures.ThreadPoolExecutor(2) as hashing:  # pearl: as the simulated server, every
            digests = [hashing.submit(tensor_digests, receive_bucket(pg, *bucket, buffers),  # tensor's checksum
                                      buffers) for bucket in spec]  # beside the next bucket's transfer
            for digest in digests:
                digest.result()
        pg.barrier().wait()
        for _, n in names:  # raw: one broadcast per tensor
            buf = torch.empty(n, dtype=torch.bfloat16)
            pg.broadcast([buf], opts).wait()
        pg.barrier().wait()
    leave_group(pg)
    done.set()


def broadcast(state: dict[str, Any], nbytes: int, repeat: int, bucket_mb: int) -> dict[str, Any]:
    import torch.distributed as dist

    buckets = layout(state, bucket_mb * MB)
    checksums = {n: sha for b in buckets for n, sha in zip(b.names, b.checksums, strict=True)}
    spec = [(b.names, b.dtypes, b.shapes) for b in buckets]
    names = [(name, t.numel()) for name, t in state.items()]
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=_receiver, args=(port, nbytes, repeat, names, spec, done))
    proc.start()
    try:
        pg = join_group("127.0.0.1", port, 0, 2, timeout_s=300)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pearl, raw = [], []
        spare: list[Any] = []  # the sync group's packing buffers, kept from one version to the next
        for _ in range(repeat):
            t = time.perf_counter()
            for buf in packed(layout(state, bucket_mb * MB, checksums), spare):  # the manifest's checksums
                send_packed(pg, buf)
            pg.barrier().wait()  # the receiver hashed every tensor
            pearl.append(time.perf_counter() - t)
            t = time.perf_counter()
            for tensor in state.values():
                pg.broadcast([tensor], opts).wait()
            pg.barrier().wait()
            raw.append(time.perf_counter() - t)
        leave_group(pg)  # the next size makes a group of the same name
    finally:
        proc.join(120)
        if proc.is_alive():
            proc.kill()
    p, r = min(pearl), min(raw)
    return {"pearl_checked_mb_per_s": _rate(nbytes, p), "raw_torch_broadcast_mb_per_s": _rate(nbytes, r),
            "pearl_s": round(p, 3), "raw_s": round(r, 3), "ratio_pearl_to_raw": round(r / p, 3),
            "buckets": len(buckets), "bucket_mb": bucket_mb, "receivers": 1, "backend": "gloo"}


def latency(server: BenchServer, broker: str, servers: int, repeat: int, work: Path) -> dict[str, Any]:
    from pearl.controlplane.core.inventory import parse_inventory
    from pearl.controlplane.store.db import make_engine, transaction
    from pearl.controlplane.store.inventory_import import import_inventory
    from weights_support import LiveFleet, snapshot  # tests/weights_support.py

    url = server.pearl_database("bench_weights")
    engine = make_engine(url)
    half = servers // 2
    raw = {"model": "qwen3-8b", "gpu": "h100", "tp": 1, "nodes": [
        {"name": "node-a", "zone": "rollout", "gpus": half, "address": "127.0.0.1"},
        {"name": "node-b", "zone": "rollout", "gpus": servers - half, "address": "127.0.0.1"}]}
    with transaction(engine, actor="bench") as session:
        import_inventory(session, parse_inventory(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARL_")}
    env["PEARL_HOME"] = str(work / "home")
    run_dir = work / f"run-{servers}-{broker.split(':')[0]}"
    run_dir.mkdir(parents=True, exist_ok=True)
    fleet = LiveFleet(engine, url, broker, run_dir, env, sim_args=("--weight-load-s", "0.2"), lease_s=60.0)
    try:
        t = time.perf_counter()
        for node in ("node-a", "node-b"):
            fleet.start_agent(node)
            fleet.start_worker(node, concurrency=max(4, servers // 2))
        fleet.serve(set(range(1, servers + 1)), timeout_s=300)
        up_s = time.perf_counter() - t
        times = []
        for k in range(1, repeat + 1):
            path = snapshot(run_dir / "snapshots" / f"v{k}", k)
            fleet.cp.training_begin(k, wait_s=0)
            t = time.perf_counter()
            fleet.cp.training_end(k, weights_version=k, snapshot=str(path))
            while any(v < k for v in fleet.versions().values()):
                time.sleep(0.01)
            times.append(time.perf_counter() - t)
        return {"servers": servers, "repeat": repeat, "fleet_up_s": round(up_s, 1),
                "p50_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
                "min_s": round(min(times), 3)}
    finally:
        fleet.stop()
        engine.dispose()
        server.drop(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version for a smoke test")
    parser.add_argument("--database-url", help="a maintenance database (default: an embedded server)")
    parser.add_argument("--broker-url", help="a Redis broker (default: the embedded Redis)")
    parser.add_argument("--amqp-url", help="a RabbitMQ broker (amqp://...); without one the RabbitMQ runs are skipped")
    parser.add_argument("--sizes-mb", default=None, help="comma-separated (default 100,1024)")
    parser.add_argument("--servers", default=None, help="comma-separated (default 4,16)")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()
    sizes = [int(x) for x in (args.sizes_mb or ("16" if args.quick else "100,1024")).split(",")]
    fleets = [int(x) for x in (args.servers or ("2" if args.quick else "4,16")).split(",")]
    repeat = args.repeat or (2 if args.quick else 3)
    started = time.perf_counter()
    out: dict[str, Any] = {"bench": "weight_sync", "quick": args.quick, "repeat": repeat, "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="pearl-bench-weights-") as tmp:
        work = Path(tmp)
        if not args.skip_throughput:
            out["throughput"] = []
            for size in sizes:
                state = state_dict(size * MB)
                nbytes = sum(t.numel() * t.element_size() for t in state.values())
                out["throughput"].append({
                    "mb": round(nbytes / MB), "tensors": len(state),
                    "snapshot_load": snapshot_load(state, nbytes, work / f"s{size}", repeat),
                    "broadcast": broadcast(state, nbytes, repeat, args.bucket_mb)})
                del state
        if not args.skip_latency:
            from pearl.controlplane.services.embedded import start_redis, stop_redis

            brokers: list[tuple[str, str]] = []
            started_redis = args.broker_url is None
            brokers.append(("redis", args.broker_url or start_redis(work / "redis-home")))
            if args.amqp_url:
                brokers.append(("rabbitmq", args.amqp_url))
            try:
                with BenchServer(args.database_url) as server:
                    out["database"] = server.settings()
                    out["latency"] = {name: [latency(server, url, n, repeat, work) for n in fleets]
                                      for name, url in brokers}
            finally:
                if started_redis:
                    stop_redis(work / "redis-home")
    out["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    out["at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
