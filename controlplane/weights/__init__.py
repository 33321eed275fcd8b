"""pearl's Python API for weights: write a snapshot from a torch state dict, check one, publish one.

    from pearl.controlplane.weights import publish_weights

    publish_weights(model.state_dict(), "/shared/ckpt/v8", step=7, version=8)
    # = write_snapshot(...) then ControlPlane().training_end(7, weights_version=8, snapshot=...)

A snapshot is a directory of safetensors and a `manifest.json` (each tensor's dtype, shape and
BLAKE3 checksum; `controlplane/weights/files.py`). `training_end` registers it (`controlplane/store/weights.py`)
only when its files match the manifest: a mismatch is refused naming the tensor, and nothing is
written. Then one sync per serving worker goes to its node's queue (`controlplane/weights/dispatch.py`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pearl.controlplane.errors import BadInput
from pearl.controlplane.weights.files import (
    Snapshot,
    SnapshotError,
    load_snapshot,
    manifest_path,
    read_manifest,
    write_state_dict,
)


def snapshot_path(uri: str) -> Path:
    """The local path of a snapshot URI (a path or a file:// URI); BadInput for anything else."""
    if not isinstance(uri, str) or not uri.strip():
        raise BadInput("snapshot: a path or file:// URI is required")
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        return Path(unquote(parts.path) if parts.scheme else uri)
    raise BadInput(f"snapshot: {uri!r}: only local paths and file:// URIs are supported (shared storage "
                   "mounted on every node)")


def absolute_uri(uri: str) -> str:
    """A snapshot URI as registered: a relative path made absolute against this process's working
    directory (a relative one would be read against each reader's own), a file:// URI as given."""
    if urlsplit(uri).scheme == "file":
        return uri
    return str(snapshot_path(uri).resolve())


def check_snapshot(uri: str) -> Snapshot:
    """Read every tensor of the snapshot at `uri` and check it against its manifest (required).
    BadInput naming the tensor when they do not match."""
    path = snapshot_path(uri)
    if not path.exists():
        raise BadInput(f"snapshot: {uri}: no such file or directory")
    try:
        if read_manifest(path) is None:
            raise BadInput(f"snapshot: {uri}: no {manifest_path(path).name} (write snapshots with "
                           "pearl.controlplane.weights.write_snapshot)")
        snap = load_snapshot(str(path))
        listed = set((read_manifest(path) or {}).get("tensors", {}))
        unlisted = sorted(set(snap.info) - listed)
        if unlisted:
            raise BadInput(f"snapshot: tensor {unlisted[0]}: in the snapshot, missing from its manifest")
        return snap
    except SnapshotError as exc:
        raise BadInput(f"snapshot: {exc}") from None


def write_snapshot(state_dict: dict[str, Any], directory: str | Path, *, version: int | None = None,
                   model_dir: str | Path | None = None) -> Snapshot:
    """Write a torch state dict as a snapshot (safetensors and its manifest) in `directory`; with
    `model_dir` (a Hugging Face model folder) its config and tokenizer files go beside them, so that
    SGLang loads the snapshot as a model."""
    try:
        return write_state_dict(directory, state_dict, version=version, model_dir=model_dir)
    except SnapshotError as exc:
        raise BadInput(f"{'model_dir' if 'model_dir' in str(exc) else 'state_dict'}: {exc}") from None


def publish_weights(state_dict: dict[str, Any], directory: str | Path, *, step: int, version: int,
                    cp: Any = None, group: Any = None, actor: str = "trainer",
                    model_dir: str | Path | None = None) -> dict[int, str]:
    """Write the snapshot, then report the training step's end with it: every serving worker is
    brought to `version` (`cp`: a ControlPlane; default: a new one on PEARL_DATABASE_URL). With a
    sync group (`broadcast.SyncGroup`, set up), its members get the tensors by broadcast first; the
    others, and any member the broadcast did not reach, by the snapshot. Worker id -> how."""
    from pearl.controlplane.api import ControlPlane

    snap = write_snapshot(state_dict, directory, version=version, model_dir=model_dir)
    delivered: dict[int, str] = {}
    if group is not None:
        results = group.broadcast(state_dict, version, {n: t.checksum for n, t in snap.info.items()})
        delivered = {w: group.members[w] for w, error in results.items() if error is None}
    own = cp is None
    cp = cp or ControlPlane()
    try:
        tasks = cp.training_end(step, weights_version=version, snapshot=str(directory), actor=actor,
                                delivered=delivered)
    finally:
        if own:
            cp.close()
    how = {t.worker_id: "snapshot" for t in tasks}
    how.update({w: "broadcast" for w in delivered if w not in how})
    return how


def write_demo_snapshot(directory: Path, version: int) -> str:
    """The demo trainer's weights for `version`: a few small tensors, different every version (numpy,
    so the demo needs no torch)."""
    import numpy as np

    rng = np.random.default_rng(version)
    state: dict[str, Any] = {f"model.layers.{i}.mlp.weight": rng.standard_normal((64, 128)).astype(np.float16)
                             for i in range(4)}
    state["model.embed_tokens.weight"] = rng.standard_normal((256, 64)).astype(np.float16)
    state["model.norm.bias"] = np.full((64,), random.Random(version).random(), dtype=np.float32)
    write_snapshot(state, directory, version=version)
    return str(directory)
