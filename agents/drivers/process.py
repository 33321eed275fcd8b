"""What both drivers share: server processes launched, found again, waited for and stopped by PID.

A launched server runs in its own session (process group), so it outlives the agent that started
it; its record, `worker-<id>.json` in the node's run directory, holds the pid, the process start time
(in ticks since boot: a reused pid is never mistaken for it), the endpoint, role, generation and log
file, and is what the next agent on the node reads to adopt the server. Every server also carries
its run directory and worker id in its environment (`PEARL_SERVER`), so one whose launcher died
before writing its record is found and killed before the worker's next launch. Stop: SIGTERM to the
pid, SIGKILL to its process group after the grace period (SGLang's scheduler and detokenizer
processes included).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
from pearl.controlplane.core.domain import Role

from .base import DriverError, Server, ServerSpec

log = logging.getLogger("pearl.agent")

# Servers this process launched, by pid: polled (so they never linger as zombies) and kept for the life of
# the process, since a server is meant to outlive the driver object (and the agent) that launched it.
LAUNCHED: dict[int, subprocess.Popen] = {}
KILL_WAIT_S = 30.0  # a SIGKILLed server is gone within this, unless stuck in the kernel
TAG = "PEARL_SERVER"  # in every server's environment: "<run dir>:<worker id>"
EXEC_WAIT_S = 10.0  # a launch returns once its server shows its tag (the exec done), or after this


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat, field 22): unlike a
    wall-clock start time (psutil's create_time adds the boot time, which moves when the clock is
    stepped) it names the same process for as long as it lives. None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def carries_tag(pid: int, tag: str, timeout_s: float) -> bool:
    """Wait until `pid` shows `tag` in its environment; False if it exits first or `timeout_s` passes.
    Popen returns once the exec has begun, but the kernel sets up the new program's environment a
    moment later: until then /proc/<pid>/environ reads empty (9 launches in 300, read right after Popen
    on two cores kept busy), and a scan by tag would miss the server."""
    deadline = time.monotonic() + timeout_s
    needle = f"{TAG}={tag}".encode()
    while True:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    return True
        except OSError:
            return False
        if not _alive(pid, None, LAUNCHED) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def every_process(attrs: list[str]) -> Iterator[psutil.Process]:
    """Every process running now, each with `info` (its `attrs`), read afresh. Not psutil's
    `process_iter`: that reuses the Process objects of its last call, and once any check has found a
    cached object's pid reused by a newer process, its next call skips that pid altogether, so a
    server started under a recycled pid could be missed."""
    for pid in psutil.pids():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.info = proc.as_dict(attrs)
            yield proc


def _alive(pid: int, started: float | None, children: dict[int, subprocess.Popen] | None = None,
           ticks: int | None = None) -> bool:
    """Whether `pid` still runs as the process a record names: by its start in ticks since boot, or
    else (records written without it) by its wall-clock start time."""
    proc = (children or {}).get(pid)
    if proc is not None:
        if proc.poll() is not None:  # launched here and exited: reaped
            children.pop(pid, None)
            return False
    else:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # reap it if this process launched it and it exited
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        if ticks is not None:
            return start_ticks(pid) == ticks
        return started is None or abs(proc.create_time() - started) < 0.5
    except psutil.Error:
        return False


class ProcessDriver:
    """Launch, adopt and stop server processes; subclasses say how a server is launched (`command`)."""

    name = "process"

    def __init__(self, run_dir: Path | str, env: dict[str, str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self._children = LAUNCHED

    def secret_file(self, name: str, content: str) -> Path:
        """A file only this user can read, in the run dir: how a secret reaches a server without being
        on its command line (which every user of the node can read)."""
        path = self.run_dir / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(path, 0o600)
        return path

    # -- what differs per driver -----------------------------------------------------------------

    def command(self, spec: ServerSpec, port: int, bootstrap_port: int | None) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def bootstrap_port(self, spec: ServerSpec) -> int | None:
        return free_port() if spec.role in (Role.PREFILL, Role.DECODE) else None

    # -- records ---------------------------------------------------------------------------------

    def _record(self, worker_id: int) -> Path:
        return self.run_dir / f"worker-{worker_id}.json"

    def _read(self, worker_id: int) -> dict | None:
        try:
            return json.loads(self._record(worker_id).read_text())
        except (OSError, ValueError):
            return None

    def running(self, worker_id: int) -> Server | None:
        raw = self._read(worker_id)
        if raw is None:
            return None
        if not self._alive(raw):
            self._record(worker_id).unlink(missing_ok=True)
            return None
        return Server.from_dict(raw["server"])

    def _alive(self, raw: dict) -> bool:
        return _alive(raw["server"]["pid"], raw.get("started"), self._children, raw.get("start_ticks"))

    def servers(self) -> list[Server]:
        found = []
        for path in sorted(self.run_dir.glob("worker-*.json")):
            with contextlib.suppress(ValueError):
                server = self.running(int(path.stem.split("-", 1)[1]))
                if server is not None:
                    found.append(server)
        return found

    def record_role(self, worker_id: int, role: Role) -> None:
        """The server flipped in place (prefill <-> decode): its record says the new role."""
        raw = self._read(worker_id)
        if raw is None:
            raise DriverError(f"worker {worker_id}: no server record to update")
        raw["server"]["role"] = role.value
        tmp = self._record(worker_id).with_suffix(".tmp")
        tmp.write_text(json.dumps(raw, indent=1))
        os.replace(tmp, self._record(worker_id))

    # -- launch, wait, stop ----------------------------------------------------------------------

    def launch(self, spec: ServerSpec) -> Server:
        if spec.role not in (Role.COLOCATED, Role.PREFILL, Role.DECODE):
            raise DriverError(f"worker {spec.worker_id}: no server for role {spec.role.value}")
        current = self.running(spec.worker_id)
        if current is not None:
            if current.generation == spec.generation:
                return current
            self.stop(spec.worker_id)
        self._stop_unrecorded(spec.worker_id)
        port = free_port()
        bootstrap = self.bootstrap_port(spec)
        argv, env = self.command(spec, port, bootstrap)
        log_path = self.run_dir / f"worker-{spec.worker_id}-g{spec.generation}.log"
        env = {**os.environ, **self.env, **env, TAG: self._tag(spec.worker_id)}
        with log_path.open("ab") as log:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.run_dir)
        self._children[proc.pid] = proc
        if not carries_tag(proc.pid, env[TAG], EXEC_WAIT_S) and proc.poll() is None:
            log.warning("worker %d: pid %d does not show its tag %s s after its launch", spec.worker_id, proc.pid,
                        EXEC_WAIT_S)
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            started = None
        server = Server(spec.worker_id, proc.pid, f"http://{spec.host}:{port}", spec.role, spec.generation,
                        bootstrap, str(log_path))
        record = {"server": server.to_dict(), "started": started, "start_ticks": start_ticks(proc.pid),
                  "argv": argv, "driver": self.name, "devices": list(spec.devices), "fence": spec.fence}
        tmp = self._record(spec.worker_id).with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self._record(spec.worker_id))
        return server

    def _tag(self, worker_id: int) -> str:
        return f"{self.run_dir.resolve()}:{worker_id}"

    def _stop_unrecorded(self, worker_id: int) -> list[int]:
        """Kill a server of this worker that runs without a record: its launcher was killed between
        starting it and writing the record. Found by the tag every launch puts in the environment
        (its working directory is the run dir); the pids it killed."""
        tag, here = self._tag(worker_id), str(self.run_dir.resolve())
        found = []
        for proc in every_process(["cwd"]):
            with contextlib.suppress(psutil.Error):
                if proc.info["cwd"] == here and proc.environ().get(TAG) == tag:
                    found.append(proc)
        for proc in found:  # the server and its own children (SGLang's scheduler, detokenizer) alike
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
        _, stuck = psutil.wait_procs(found, timeout=KILL_WAIT_S)
        if stuck:
            raise DriverError(f"worker {worker_id}: pids {[p.pid for p in stuck]} of a server without a record "
                              f"still there {KILL_WAIT_S:g} s after SIGKILL")
        for proc in found:
            log.warning("worker %d: killed pid %d, which ran without a record", worker_id, proc.pid)
        return [p.pid for p in found]

    def wait_ready(self, server: Server, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        from pearl.agents.server_client import http_client

        with http_client(2.0) as client:
            while True:
                if self.running(server.worker_id) is None:
                    tail = self.log_tail(server.worker_id, path=server.log_path)
                    raise DriverError(f"worker {server.worker_id}: the server exited before it was ready; "
                                      f"last lines of {server.log_path}:\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(server.endpoint + "/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise DriverError(f"worker {server.worker_id}: not ready after {timeout_s:.0f} s; last lines of "
                                      f"{server.log_path}:\n{self.log_tail(server.worker_id, path=server.log_path)}")
                time.sleep(0.05)

    def stop(self, worker_id: int, grace_s: float = 10.0, pid: int | None = None) -> bool:
        raw = self._read(worker_id)
        if raw is None or (pid is not None and raw["server"]["pid"] != pid):
            return False
        pid = raw["server"]["pid"]
        ran = self._alive(raw)
        if ran:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self._alive(raw) and time.monotonic() < deadline:
                time.sleep(0.02)
        if ran or raw.get("started") is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # the leader if it ignored SIGTERM, and whatever it left
            deadline = time.monotonic() + KILL_WAIT_S
            while self._alive(raw):
                if time.monotonic() > deadline:  # stuck in the kernel (uninterruptible): keep its record
                    raise DriverError(f"worker {worker_id}: server pid {pid} still there {KILL_WAIT_S:g} s "
                                      "after SIGKILL")
                time.sleep(0.01)
        current = self._read(worker_id)
        if current is not None and current["server"]["pid"] == pid:  # not a record a new launch wrote meanwhile
            self._record(worker_id).unlink(missing_ok=True)
        return ran

    def log_tail(self, worker_id: int, lines: int = 20, path: str | None = None) -> str:
        if path is None:
            raw = self._read(worker_id)
            if raw is not None:
                path = raw["server"]["log_path"]
            else:
                logs = sorted(self.run_dir.glob(f"worker-{worker_id}-g*.log"), key=lambda p: p.stat().st_mtime)
                path = str(logs[-1]) if logs else None
        if path is None or not Path(path).exists():
            return ""
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip("\n")
