"""The fast path: the trainer's rank broadcasts the new weights to the servers of a sync group.

A sync group is the trainer (rank 0) and some servers (ranks 1..N) joined in a torch.distributed
process group of their own (a `TCPStore` and a `ProcessGroupGloo`, or NCCL where there are GPUs),
made without touching the trainer's default group. The servers join through their HTTP API
(`/init_weights_update_group`, as SGLang's); a broadcast posts the layout to every server
(`/update_weights_from_distributed`: each tensor's name, dtype, shape, bucket, offset and sha256) and
then sends the tensors packed into buckets of `bucket_bytes`. Each server receives every bucket,
checks every tensor against its sha256 (a mismatch is refused naming the tensor, and the server
keeps its old weights), and only then takes the version.

`SyncGroup.broadcast` says which servers took the version; `publish_weights(..., group=...)` records
those as synced by broadcast, and the snapshot path (the Celery tasks) brings every other worker,
so the snapshot is always the fallback.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import math
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx
from pearl.controlplane.weights.files import DTYPE_BYTES, SnapshotError, manifest_digest, tensor_bytes

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


def join_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
               timeout_s: float = 120.0) -> Any:
    """A process group of its own (rank 0 hosts the store); blocks until every rank joined."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _broadcast(pg: Any, tensor: Any) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def layout(state_dict: dict[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
           checksums: dict[str, str] | None = None) -> tuple[dict[str, Any], list[list[tuple[str, memoryview]]]]:
    """The layout servers are told (JSON), and the tensors' bytes bucket by bucket. `checksums`: the
    registered sha256 per tensor (default: computed here)."""
    tensors: list[dict[str, Any]] = []
    buckets: list[list[tuple[str, memoryview]]] = [[]]
    sizes = [0]
    for name, tensor in state_dict.items():
        dtype, shape, data = tensor_bytes(tensor)
        if sizes[-1] and sizes[-1] + data.nbytes > bucket_bytes:
            buckets.append([])
            sizes.append(0)
        sha = (checksums or {}).get(name) or hashlib.sha256(data).hexdigest()
        tensors.append({"name": name, "dtype": dtype, "shape": shape, "bucket": len(buckets) - 1,
                        "offset": sizes[-1], "nbytes": data.nbytes, "sha256": sha})
        buckets[-1].append((name, data))
        sizes[-1] += data.nbytes
    return {"tensors": tensors, "buckets": sizes}, buckets


def _pack(bucket: list[tuple[str, memoryview]]) -> Any:
    import torch

    if len(bucket) == 1:  # one tensor: sent from its own memory, no copy
        return torch.frombuffer(bucket[0][1], dtype=torch.uint8) if bucket[0][1].nbytes else torch.empty(0)
    buf = torch.empty(sum(d.nbytes for _, d in bucket), dtype=torch.uint8)
    view = buf.numpy()
    at = 0
    for _, data in bucket:
        view[at:at + data.nbytes] = data
        at += data.nbytes
    return buf


def send(pg: Any, buckets: list[list[tuple[str, memoryview]]]) -> int:
    """Rank 0: broadcast every bucket, packing the next one while the last is on the wire; the bytes
    sent."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    total = 0
    in_flight: Any = None
    for bucket in buckets:
        buf = _pack(bucket)
        work = pg.broadcast([buf], opts)
        if in_flight is not None:
            in_flight.wait()
        in_flight = work
        total += buf.numel()
    if in_flight is not None:
        in_flight.wait()
    return total


def _check(spec_tensors: list[dict[str, Any]], data: memoryview) -> list[tuple[str, str]]:
    """(name, sha256) of each tensor of one bucket (hashlib releases the GIL: this runs beside the
    next bucket's transfer)."""
    return [(t["name"], hashlib.sha256(data[t["offset"]:t["offset"] + t["nbytes"]]).hexdigest())
            for t in spec_tensors]


def receive(pg: Any, spec: dict[str, Any]) -> dict[str, tuple[str, list[int], memoryview]]:
    """A server rank: receive every bucket of `spec` (all of them, so the collective completes),
    checking each bucket's tensors while the next one arrives; then SnapshotError naming the first
    tensor whose sha256 does not match."""
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    by_bucket: dict[int, list[dict[str, Any]]] = {}
    for t in spec["tensors"]:
        name, dtype, shape = t["name"], t["dtype"], list(t["shape"])
        if dtype not in DTYPE_BYTES or math.prod(shape) * DTYPE_BYTES[dtype] != t["nbytes"]:
            raise SnapshotError(f"tensor {name}: {t['nbytes']} bytes for shape {shape} {dtype}")
        by_bucket.setdefault(int(t["bucket"]), []).append(t)
    views: list[memoryview] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        checks = []
        for i, size in enumerate(int(n) for n in spec["buckets"]):
            buf = torch.empty(size, dtype=torch.uint8)
            pg.broadcast([buf], opts).wait()
            views.append(memoryview(buf.numpy()))
            checks.append(pool.submit(_check, by_bucket.get(i, []), views[-1]))
        digests = dict(d for c in checks for d in c.result())
    out: dict[str, tuple[str, list[int], memoryview]] = {}
    for t in spec["tensors"]:
        name = t["name"]
        if digests[name] != t["sha256"]:
            raise SnapshotError(f"tensor {name}: checksum mismatch (sha256 {digests[name][:12]}..., "
                                f"expected {str(t['sha256'])[:12]}...)")
        out[name] = (t["dtype"], list(t["shape"]), views[t["bucket"]][t["offset"]:t["offset"] + t["nbytes"]])
    return out


def layout_checksum(spec: dict[str, Any]) -> str:
    """What a server that took the broadcast reports as its `weights_checksum`."""
    return manifest_digest({t["name"]: t["sha256"] for t in spec["tensors"]})


@dataclass
class SyncGroup:
    """The trainer's side of a sync group: `members` maps worker id -> its server's endpoint."""

    members: dict[int, str]
    host: str = "127.0.0.1"
    port: int = 0
    backend: str = "gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    name: str = "pearl-sync"
    pg: Any = field(default=None, repr=False)

    def _post_all(self, path: str, body_of: Any) -> None:
        """POST to every member at once (threads); `_results` collects: worker id -> None or the error."""
        def post(item: tuple[int, int, str]) -> tuple[int, str | None]:
            i, worker, endpoint = item
            try:
                resp = httpx.post(endpoint.rstrip("/") + path, json=body_of(i), timeout=self.timeout_s + 30)
                try:
                    body = resp.json()
                except ValueError:
                    body = {"message": resp.text[:300]}
                if resp.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
                    message = body.get("message") if isinstance(body, dict) else body
                    return worker, f"{endpoint}{path}: {resp.status_code}: {message}"
                return worker, None
            except httpx.HTTPError as exc:
                return worker, f"{endpoint}{path}: no answer ({type(exc).__name__}: {exc})"

        items = [(i, w, e) for i, (w, e) in enumerate(sorted(self.members.items()))]
        self._executor = concurrent.futures.ThreadPoolExecutor(max(1, len(items)))
        self._futures = [self._executor.submit(post, item) for item in items]

    def _results(self) -> dict[int, str | None]:
        try:
            return dict(f.result() for f in self._futures)
        finally:
            self._executor.shutdown(wait=True)

    def setup(self) -> None:
        """Every member joins the group (its HTTP call and rank 0's join meet in the store)."""
        if not self.port:
            with socket.socket() as sock:
                sock.bind((self.host, 0))
                self.port = sock.getsockname()[1]
        world = len(self.members) + 1
        self._post_all("/init_weights_update_group", lambda i: {
            "master_address": self.host, "master_port": self.port, "rank_offset": i + 1, "world_size": world,
            "group_name": self.name, "backend": self.backend})
        try:
            self.pg = join_group(self.host, self.port, 0, world, self.backend, self.timeout_s)
        finally:
            errors = {w: e for w, e in self._results().items() if e}
        if errors:
            self.pg = None
            raise SnapshotError(f"sync group {self.name}: {errors}")

    def broadcast(self, state_dict: dict[str, Any], version: int,
                  checksums: dict[str, str] | None = None) -> dict[int, str | None]:
        """Send `state_dict` as `version` to every member: worker id -> None (it took the version)
        or why not."""
        if self.pg is None:
            raise SnapshotError(f"sync group {self.name}: not set up")
        spec, buckets = layout(state_dict, self.bucket_bytes, checksums)
        self._post_all("/update_weights_from_distributed", lambda i: {
            "group_name": self.name, "weight_version": str(version), "layout": spec})
        try:
            send(self.pg, buckets)
        finally:
            results = self._results()
        return results

    def close(self) -> None:
        if self.pg is not None:
            self._post_all("/destroy_weights_update_group", lambda i: {"group_name": self.name})
            self._results()
            self.pg = None
