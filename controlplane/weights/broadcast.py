"""The fast path: the trainer's rank broadcasts the new weights to the servers of a sync group.

It speaks SGLang's weight-update protocol, so the same code drives real SGLang servers and the
simulated one:

- The group: the trainer is rank 0; each server joins through `/init_weights_update_group` with
  `rank_offset` and `world_size`, and each of its TP ranks takes rank `rank_offset + tp_rank`, so a
  group of servers with TP sizes t1..tn has 1 + t1 + ... + tn ranks. Both sides meet as SGLang's
  `init_custom_process_group` does: a TCP rendezvous at the trainer's address (rank 0 hosts the
  store), a `PrefixStore` named after the group, and a process group of its own (gloo on the CPU,
  NCCL on GPUs) that does not touch the trainer's default group.
- The tensors: in buckets of at most `bucket_bytes`. For each bucket, every server is told the
  bucket's `names`, `dtypes` (torch's names) and `shapes` with `load_format: "flattened_bucket"`
  (`/update_weights_from_distributed`), then the trainer broadcasts the bucket as one flat byte
  tensor. Within a bucket tensors are ordered by element size, largest first, so every tensor starts
  at an offset its dtype is aligned to (SGLang refuses an unaligned one). Only the last bucket
  carries `weight_version` and `flush_cache`: a server takes the new version once it has every bucket.
- The check: SGLang does not verify what arrives. After the last bucket the trainer reads each
  server's `/model_info`; a server that reports `weights_checksum` (the simulated server does: the
  digest of the BLAKE3 checksum of every tensor it received, computed beside the next bucket's
  transfer, which it keeps up with) must report the digest of the registered checksums, or it is
  not counted as synced. A server that reports none (stock SGLang) is counted
  on the collective's success.

`SyncGroup.broadcast` says which servers took the version; `publish_weights(..., group=...)` records
those as synced by broadcast, and the snapshot path (the Celery tasks) brings every other worker,
so the snapshot is always the fallback.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import math
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from pearl.controlplane.services.token import bearer
from pearl.controlplane.weights.files import (
    DTYPE_BYTES,
    TORCH_DTYPES,
    SnapshotError,
    manifest_digest,
    tensor_bytes,
    tensor_checksum,
)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group name
LOAD_FORMAT = "flattened_bucket"
TORCH_NAME = {st: torch_name for torch_name, st in TORCH_DTYPES.items()}  # safetensors dtype -> torch's name


def join_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
               timeout_s: float = 120.0, group_name: str = DEFAULT_GROUP) -> Any:
    """A process group of its own, made as SGLang's `init_custom_process_group` makes it (TCP
    rendezvous, rank 0 hosts the store, a PrefixStore named after the group); blocks until every rank
    joined."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_group(pg: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


def _broadcast(pg: Any, tensor: Any) -> Any:
    import torch.distributed as dist

    return dist.broadcast(tensor, src=0, group=pg, async_op=True)


@dataclass
class Bucket:
    """One broadcast: what `/update_weights_from_distributed` names, and the tensors' bytes in order."""

    names: list[str]
    dtypes: list[str]  # torch's dtype names, as SGLang takes them
    shapes: list[list[int]]
    data: list[memoryview]
    checksums: list[str]  # `files.tensor_checksum` of each tensor

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.data)


def layout(state_dict: dict[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
           checksums: dict[str, str] | None = None) -> list[Bucket]:
    """The buckets of `state_dict`, each at most `bucket_bytes` (a larger tensor alone), each ordered
    by element size, largest first. `checksums`: the registered checksum per tensor (default: computed
    here)."""
    entries = []
    for name, tensor in state_dict.items():
        dtype, shape, data = tensor_bytes(tensor)
        sha = (checksums or {}).get(name) or tensor_checksum(data)
        entries.append((name, dtype, shape, data, sha))
    groups: list[list[tuple[str, str, list[int], memoryview, str]]] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + entry[3].nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry[3].nbytes
    buckets = []
    for group in groups:
        group.sort(key=lambda e: -DTYPE_BYTES[e[1]])  # stable: a tensor starts aligned to its dtype
        buckets.append(Bucket([e[0] for e in group], [TORCH_NAME[e[1]] for e in group], [e[2] for e in group],
                              [e[3] for e in group], [e[4] for e in group]))
    return [b for b in buckets if b.names]


def expected_checksum(buckets: list[Bucket]) -> str:
    """What a server that took every bucket reports as its `weights_checksum`."""
    return manifest_digest({n: {"dtype": TORCH_DTYPES[dtype], "shape": shape, "checksum": sha} for b in buckets
                            for n, dtype, shape, sha in zip(b.names, b.dtypes, b.shapes, b.checksums, strict=True)})


def _pack(bucket: Bucket, into: Any = None) -> Any:
    import torch

    if len(bucket.data) == 1:  # one tensor: sent from its own memory, no copy
        data = bucket.data[0]
        return torch.frombuffer(data, dtype=torch.uint8) if data.nbytes else torch.empty(0, dtype=torch.uint8)
    buf = into[:bucket.nbytes] if into is not None else torch.empty(bucket.nbytes, dtype=torch.uint8)
    view = buf.numpy()
    at = 0
    for data in bucket.data:
        view[at:at + data.nbytes] = data
        at += data.nbytes
    return buf


def packed(buckets: list[Bucket], spare: list[Any] | None = None) -> Iterator[Any]:
    """Each bucket as the flat byte tensor it is sent as, the next one packed (in a thread) while the
    caller sends this one. Buckets of several tensors are packed into two buffers kept for the whole
    broadcast, in turn (a fresh buffer per bucket faults its pages in every time, which cost more
    than the copy): a bucket's buffer is packed again once the caller asks for the bucket after the
    next, so the caller is done sending a bucket when it asks for the next one. `spare`: the two
    buffers, kept by the caller from one broadcast to the next (replaced here when too small)."""
    import torch

    size = max((b.nbytes for b in buckets if len(b.data) > 1), default=0)
    spare = spare if spare is not None else []
    if size and (len(spare) != 2 or any(buf.numel() < size for buf in spare)):
        spare[:] = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
    elif not size:
        spare = [None, None]
    with concurrent.futures.ThreadPoolExecutor(1) as packer:
        ahead = packer.submit(_pack, buckets[0], spare[0]) if buckets else None
        for k in range(len(buckets)):
            assert ahead is not None
            buf = ahead.result()
            ahead = packer.submit(_pack, buckets[k + 1], spare[(k + 1) % 2]) if k + 1 < len(buckets) else None
            yield buf


def send_packed(pg: Any, buf: Any) -> int:
    """Rank 0: broadcast one packed bucket; the bytes sent."""
    _broadcast(pg, buf).wait()
    return buf.numel()


def tensor_digests(tensors: list[tuple[str, str, list[int], memoryview]],
                   buffers: ReceiveBuffers | None = None) -> dict[str, dict[str, Any]]:
    """What a receiver that checks records of a received bucket: name -> dtype (safetensors'), shape,
    checksum (BLAKE3 releases the GIL: this runs beside the next bucket's transfer). The bucket's
    buffer then goes back to `buffers`."""
    out = {name: {"dtype": TORCH_DTYPES[dtype], "shape": shape, "checksum": tensor_checksum(data)}
           for name, dtype, shape, data in tensors}
    if buffers is not None:
        buffers.give(tensors)
    return out


class ReceiveBuffers:
    """Byte buffers a receiver takes its buckets into and gives back once it has checked them: a
    fresh buffer per bucket faults its pages in while the collective writes it."""

    def __init__(self, keep: int = 3) -> None:
        self._free: list[Any] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Any:
        import numpy as np

        with self._lock:
            for i, arr in enumerate(self._free):
                if arr.nbytes >= nbytes:
                    return self._free.pop(i)
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, tensors: list[tuple[str, str, list[int], memoryview]]) -> None:
        """Give back the buffer a bucket's tensors (`receive_bucket`'s answer) were received into."""
        arr = tensors[0][3].obj if tensors else None
        with self._lock:
            if arr is not None and len(self._free) < self._keep and all(a is not arr for a in self._free):
                self._free.append(arr)


def receive_bucket(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
                   buffers: ReceiveBuffers | None = None) -> list[tuple[str, str, list[int], memoryview]]:
    """A server rank: receive one flattened bucket as SGLang does (`FlattenedTensorBucket.empty`: a
    negative dimension or a tensor not aligned to its dtype is refused before anything is received);
    (name, torch dtype, shape, bytes) per tensor, into a buffer of `buffers` when given."""
    import numpy as np
    import torch

    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise SnapshotError(f"a bucket needs as many names, dtypes and shapes, at least one: "
                            f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    spans = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if dtype not in TORCH_DTYPES:
            raise SnapshotError(f"tensor {name}: dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        if any(int(d) < 0 for d in shape):
            raise SnapshotError(f"Negative dimension in received tensor {name}: {list(shape)}")
        itemsize = DTYPE_BYTES[TORCH_DTYPES[dtype]]
        if offset % itemsize:
            raise SnapshotError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = math.prod(int(d) for d in shape) * itemsize
        spans.append((name, dtype, [int(d) for d in shape], offset, size))
        offset += size
    arr = buffers.take(offset) if buffers is not None else np.empty(offset, dtype=np.uint8)
    _broadcast(pg, torch.from_numpy(arr[:offset])).wait()
    view = memoryview(arr)
    return [(name, dtype, shape, view[at:at + size]) for name, dtype, shape, at, size in spans]


@dataclass
class SyncGroup:
    """The trainer's side of a sync group: `members` maps worker id -> its server's endpoint, `tp`
    worker id -> its server's TP size (default 1: one rank)."""

    members: dict[int, str]
    host: str = "127.0.0.1"
    port: int = 0
    backend: str = "gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    name: str = DEFAULT_GROUP
    tp: dict[int, int] = field(default_factory=dict)
    token: str | None = field(default=None, repr=False)  # the control token (the servers' admin API key)
    pg: Any = field(default=None, repr=False)
    _spare: list[Any] = field(default_factory=list, repr=False)  # `packed`'s buffers, kept between versions

    @property
    def world_size(self) -> int:
        return 1 + sum(self.tp.get(w, 1) for w in self.members)

    def rank_offsets(self) -> dict[int, int]:
        """Worker id -> the rank of its server's TP rank 0 (the trainer is rank 0)."""
        out, rank = {}, 1
        for worker in sorted(self.members):
            out[worker] = rank
            rank += self.tp.get(worker, 1)
        return out

    # -- what each server is sent (SGLang's request types) -----------------------------------------

    def init_body(self, worker: int) -> dict[str, Any]:
        return {"master_address": self.host, "master_port": self.port, "rank_offset": self.rank_offsets()[worker],
                "world_size": self.world_size, "group_name": self.name, "backend": self.backend}

    def bucket_body(self, bucket: Bucket, version: int, last: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                                "group_name": self.name, "load_format": LOAD_FORMAT, "flush_cache": last}
        if last:
            body["weight_version"] = str(version)
        return body

    def destroy_body(self) -> dict[str, Any]:
        return {"group_name": self.name}

    # -- the calls ------------------------------------------------------------------------------

    def _post_all(self, path: str, body_of: Any) -> None:
        """POST to every member at once (threads); `_results` collects: worker id -> None or the error."""
        def post(item: tuple[int, str]) -> tuple[int, str | None]:
            worker, endpoint = item
            try:
                resp = httpx.post(endpoint.rstrip("/") + path, json=body_of(worker), timeout=self.timeout_s + 30,
                                  headers=bearer(self.token))
                try:
                    body = resp.json()
                except ValueError:
                    body = {"message": resp.text[:300]}
                if resp.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
                    message = body.get("message") or body.get("detail") if isinstance(body, dict) else body
                    return worker, f"{endpoint}{path}: {resp.status_code}: {message}"
                return worker, None
            except httpx.HTTPError as exc:
                return worker, f"{endpoint}{path}: no answer ({type(exc).__name__}: {exc})"

        items = sorted(self.members.items())
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
        self._post_all("/init_weights_update_group", self.init_body)
        try:
            self.pg = join_group(self.host, self.port, 0, self.world_size, self.backend, self.timeout_s, self.name)
        finally:
            errors = {w: e for w, e in self._results().items() if e}
        if errors:
            self.pg = None
            raise SnapshotError(f"sync group {self.name}: {errors}")

    def broadcast(self, state_dict: dict[str, Any], version: int,
                  checksums: dict[str, str] | None = None) -> dict[int, str | None]:
        """Send `state_dict` as `version` to every member: worker id -> None (it took the version)
        or why not. A bucket any member refused ends the broadcast for all (the collective needs
        every rank); the snapshot path then brings them."""
        if self.pg is None:
            raise SnapshotError(f"sync group {self.name}: not set up")
        buckets = layout(state_dict, self.bucket_bytes, checksums)
        for k, (bucket, buf) in enumerate(zip(buckets, packed(buckets, self._spare), strict=True)):
            last = k == len(buckets) - 1
            self._post_all("/update_weights_from_distributed",
                           lambda w, b=bucket, last=last: self.bucket_body(b, version, last))
            try:
                send_packed(self.pg, buf)
            finally:
                results = self._results()
            errors = {w: e for w, e in results.items() if e}
            if errors:
                return {w: errors.get(w) or f"the broadcast stopped at bucket {k + 1} of {len(buckets)}: {errors}"
                        for w in self.members}
        return self._verify(expected_checksum(buckets), version)

    def _verify(self, checksum: str, version: int) -> dict[int, str | None]:
        """Each member's `/model_info`: the version taken and, where it reports one, the checksum."""
        out: dict[int, str | None] = {}
        for worker, endpoint in sorted(self.members.items()):
            try:
                info = httpx.get(endpoint.rstrip("/") + "/model_info", timeout=self.timeout_s).json()
            except (httpx.HTTPError, ValueError) as exc:
                out[worker] = f"{endpoint}/model_info: no answer ({type(exc).__name__}: {exc})"
                continue
            got = info.get("weights_checksum") if isinstance(info, dict) else None
            if isinstance(info, dict) and str(info.get("weight_version")) != str(version):
                out[worker] = (f"{endpoint}: serves version {info.get('weight_version')} after the broadcast "
                               f"of {version}")
            elif got is not None and got != checksum:
                out[worker] = (f"{endpoint}: weights checksum {str(got)[:12]}... after the broadcast, "
                               f"registered {checksum[:12]}...")
            else:
                out[worker] = None
        return out

    def close(self) -> None:
        if self.pg is not None:
            self._post_all("/destroy_weights_update_group", lambda w: self.destroy_body())
            self._results()
            leave_group(self.pg)
            self.pg = None
