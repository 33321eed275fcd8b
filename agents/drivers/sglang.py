"""The `sglang` driver: each worker's server is `python -m sglang.launch_server` on the worker's GPUs.

Command lines, per role (flags as SGLang's `ServerArgs` defines them; tests/conformance parses each
with SGLang's own parser):

- every server: `--model-path`: the trainer's latest weight snapshot (a folder SGLang loads as a model:
  the safetensors, pearl's manifest, and the model's config and tokenizer files, which
  `write_snapshot(..., model_dir=...)` copies in), else the driver's `model_path` (a Hugging Face
  model folder or hub id: the catalog's name is not one); `--served-model-name` (the catalog model,
  so every server of the model answers under one name whatever its snapshot),
  `--tp-size`, `--host`, `--port`, `--nccl-port` and `--engine-info-bootstrap-port` (distinct per
  server on a node: several servers share a node), `--weight-version`;
- prefill and decode: `--disaggregation-mode`, `--disaggregation-bootstrap-port` (distinct per server;
  decode servers get one too, for a flip to prefill), `--disaggregation-transfer-backend` (mooncake:
  role switch needs mooncake or mori) and `--enable-pd-role-switch`;
- a server on borrowed training GPUs (`spec.overlap`): `--enable-memory-saver` and
  `--enable-weights-cpu-backup`, so that release/resume_memory_occupation hand the memory back
  between loans and the weights come back intact (without the backup SGLang resumes with the
  weights' memory uninitialised);
- `CUDA_VISIBLE_DEVICES` from the worker's devices (exactly `tp` of them);
- with a control token: `--config` naming a YAML file only this user can read that sets SGLang's
  `admin-api-key` to it, so that every command (pause, load, switch, release) needs the token.

Prefill <-> decode is `/pd_role_switch` on the running server after a drain (to decode: told the
decode CUDA graph memory a decode peer reports; agents/steps.py restarts a server that refuses);
colocated <-> split is a restart (SGLang cannot flip to or from colocated).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pearl.controlplane.core.domain import Role

from .base import DriverError, ServerSpec
from .process import ProcessDriver, free_port


class SglangDriver(ProcessDriver):
    name = "sglang"

    def __init__(self, run_dir: Path | str, python: str = sys.executable, transfer_backend: str = "mooncake",
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 model_path: str | None = None, ib_device: str | None = None,
                 admin_api_key: str | None = None) -> None:
        super().__init__(run_dir, env)
        # SGLang's admin API key, given in a YAML `--config` only this user reads (not on the command line)
        self.config_file = (self.secret_file("sglang-admin.yaml", json.dumps({"admin-api-key": admin_api_key}) + "\n")
                            if admin_api_key else None)
        self.python = python
        self.transfer_backend = transfer_backend
        self.model_path = model_path  # what a server loads before the trainer registered any snapshot
        self.ib_device = ib_device  # --disaggregation-ib-device (the RDMA NICs of the KV transfer)
        self.extra_args = tuple(extra_args)  # e.g. ("--load-format", "dummy", "--mem-fraction-static", "0.8")

    def _model_path(self, spec: ServerSpec) -> str:
        if spec.weights is None:
            if not self.model_path:
                raise DriverError(f"worker {spec.worker_id}: no weight snapshot is registered and the driver has no "
                                  f"model path (`pearlctl agent --model-path`): SGLang cannot load {spec.model!r}")
            return self.model_path
        local = Path(spec.weights.uri)
        if local.is_dir() and not (local / "config.json").is_file():
            raise DriverError(f"worker {spec.worker_id}: snapshot {local} has no config.json, so SGLang cannot load "
                              "it; write it with the model's files (write_snapshot(..., model_dir=MODEL_FOLDER))")
        return spec.weights.uri

    def command(self, spec: ServerSpec, port: int, bootstrap_port: int | None) -> tuple[list[str], dict[str, str]]:
        if len(spec.devices) != spec.tp:
            raise DriverError(f"worker {spec.worker_id}: tp {spec.tp} needs as many devices, got {list(spec.devices)}")
        model_path = self._model_path(spec)
        version = str(spec.weights.version) if spec.weights is not None else "default"
        argv = [self.python, "-m", "sglang.launch_server", "--model-path", model_path,
                "--served-model-name", spec.model, "--tp-size", str(spec.tp), "--host", spec.host,
                "--port", str(port), "--nccl-port", str(free_port()),
                "--engine-info-bootstrap-port", str(free_port()), "--weight-version", version]
        if spec.role in (Role.PREFILL, Role.DECODE):
            argv += ["--disaggregation-mode", spec.role.value, "--disaggregation-bootstrap-port", str(bootstrap_port),
                     "--disaggregation-transfer-backend", self.transfer_backend, "--enable-pd-role-switch"]
            if self.ib_device:
                argv += ["--disaggregation-ib-device", self.ib_device]
        elif spec.role is not Role.COLOCATED:
            raise DriverError(f"worker {spec.worker_id}: no server for role {spec.role.value}")
        if spec.overlap:
            argv += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
        if self.config_file is not None:
            argv += ["--config", str(self.config_file)]
        argv += list(self.extra_args)
        return argv, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.devices))}
