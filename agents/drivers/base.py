"""What a node agent needs from a driver: launch, find and stop the server of one worker slot.

A driver owns the server *processes* of its node. Everything else an agent does to a server (health,
drain, interrupt, release and resume memory, role switch, weights) goes over SGLang's HTTP API
(`agents.server_client.ServerClient`), which the real server and the simulated one (`pearl
simworker`) both speak; so the two drivers differ only in how a process is launched:

- `sglang`: `python -m sglang.launch_server ...` with the role's flags, `CUDA_VISIBLE_DEVICES` from
  the worker's GPUs (`drivers/sglang.py`);
- `sim`: `pearlctl simworker ...`, a simulated SGLang server timed by the performance model
  (`drivers/sim.py`).

Agents are stateless, so a driver keeps what it launched where the next agent on the node finds it:
one JSON file per running server under the node's run directory (`$PEARL_HOME/run/<node>/`), with
its pid, endpoint, role, generation and log file. A server outlives the agent that launched it (a
restarted agent adopts it); it never outlives its stop.

Fencing: every command an agent sends to a server carries the fencing token of the step it runs
(`X-Pearl-Fence`); the simulated server refuses a token older than the newest it has seen (HTTP 409),
so an agent whose claim was taken over cannot change the server any more.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from pearl.controlplane.core.domain import Role
from pearl.controlplane.errors import PearlError

FENCE_HEADER = "X-Pearl-Fence"  # the fencing token of the step that sends a command to a server


class DriverError(PearlError):
    """The server could not be driven (it did not start, died, or refused a command)."""

    def __init__(self, message: str | None = None, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status a server refused the command with; None: no answer


@dataclass(frozen=True)
class WeightsRef:
    """The weights a server loads at start: a registered snapshot."""

    version: int
    uri: str  # a directory or file of safetensors (a path on shared storage)


@dataclass(frozen=True)
class ServerSpec:
    """Everything needed to launch the server of one worker slot."""

    worker_id: int
    node: str
    host: str  # the node's address: the server binds to it and registers under it
    role: Role  # colocated, prefill or decode
    devices: tuple[int, ...]  # CUDA device indices on the node (CUDA_VISIBLE_DEVICES)
    tp: int
    model: str  # catalog model name (or a model path for sglang)
    gpu: str  # catalog GPU name (the simulated server's timing)
    generation: int  # the worker's generation (+1 at each start)
    fence: int  # the fencing token of the step that launches it
    overlap: bool  # on borrowed training GPUs: launched with the memory saver, released between loans
    weights: WeightsRef | None = None  # the snapshot to load at start; None: the initial weights


@dataclass(frozen=True)
class Server:
    """A server process a driver launched and still tracks."""

    worker_id: int
    pid: int
    endpoint: str  # http://host:port
    role: Role
    generation: int
    bootstrap_port: int | None  # prefill servers: where decode servers pull the KV from
    log_path: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "role": self.role.value}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Server:
        return cls(**{**raw, "role": Role(raw["role"])})


class Driver(Protocol):
    """Launches and stops the servers of one node (see the module docstring)."""

    name: str
    run_dir: Path

    def launch(self, spec: ServerSpec) -> Server:
        """Start the server process and return at once (readiness is `wait_ready`). Idempotent: when
        a server of this worker and generation already runs, return it; an older one is stopped first."""
        ...

    def running(self, worker_id: int) -> Server | None:
        """The live server this node runs for the worker, or None (a dead one's record is removed)."""
        ...

    def servers(self) -> list[Server]:
        """Every live server of this node."""
        ...

    def wait_ready(self, server: Server, timeout_s: float) -> None:
        """Return once the server answers `/health`; raise DriverError with the last lines of its log
        when the process exits or the timeout passes."""
        ...

    def stop(self, worker_id: int, grace_s: float = 10.0, pid: int | None = None) -> bool:
        """SIGTERM, then SIGKILL after `grace_s`, by PID (never by name); idempotent. True if one ran.
        With `pid`, only while the worker's server is still that process (another may have replaced it)."""
        ...

    def record_role(self, worker_id: int, role: Role) -> None:
        """The server now serves in `role` (it flipped in place); its record says so."""
        ...

    def log_tail(self, worker_id: int, lines: int = 20) -> str:
        """The last lines of the worker's server log ('' if none)."""
        ...
