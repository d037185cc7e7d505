"""The local Ray cluster `nowait fleet up` starts when `fleet.ray_address` is unset, and where the
running fleet is written down (`fleet status` and `fleet down` read it).

The cluster is `ray start --head` with its own temporary directory and a marker in its
environment, which every process it starts inherits (GCS, raylet, Serve's actors, the replicas):
`fleet down` ends exactly those, by id, and no other Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_ENV = "NOWAIT_FLEET_STATE"  # where the running fleet is written down (default ~/.nowait/fleet.json)
MARKER = "NOWAIT_FLEET_CLUSTER"  # in the environment of every process of a local cluster


class FleetError(RuntimeError):
    """A fleet command that cannot go on; the message is one line for the user."""


@dataclass(frozen=True)
class FleetState:
    address: str  # the Ray cluster's GCS address
    url: str  # the gateway's
    local_cluster: str | None = None  # the local cluster's marker (its temporary directory); None: not ours


def state_path() -> Path:
    return Path(os.environ.get(STATE_ENV) or Path.home() / ".nowait" / "fleet.json")


def save_state(state: FleetState) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(state)), encoding="utf-8")


def load_state() -> FleetState | None:
    try:
        return FleetState(**json.loads(state_path().read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def clear_state() -> None:
    state_path().unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_command() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


def start_local_cluster(num_cpus: float | None = None, num_gpus: float | None = None,
                        worker_niceness: int = 0) -> tuple[str, str]:
    """`ray start --head` on this machine: (its GCS address, its marker). Its raylet starts every
    worker process (the replicas) at `worker_niceness`."""
    port = _free_port()
    temp_dir = f"/tmp/nowait-fleet-{port}"  # short: Ray's socket paths live under it
    command = [_ray_command(), "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}",
               "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={_free_port()}"]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus:g}")
    if num_gpus is not None:
        command.append(f"--num-gpus={num_gpus:g}")
    # Ray's raylet reads its settings from RAY_<name>; its worker_niceness default (15) would run
    # each engine below the raylet, the proxies and the clients on the same cores, so a busy CPU
    # stretches every decode step (docs/fleet.md, "Worker niceness").
    env = {**os.environ, MARKER: temp_dir, "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": str(worker_niceness)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        stop_local_cluster(temp_dir)
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FleetError(f"could not start a local Ray cluster ({' '.join(command[:3])}): {last[0]}")
    return f"127.0.0.1:{port}", temp_dir


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def cluster_processes(marker: str) -> list[int]:
    """Every process of the cluster (Linux /proc): those whose environment carries its marker,
    and the raylet's agents, which start with a fresh environment naming their raylet."""
    wanted = f"{MARKER}={marker}".encode()
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and int(e.name) != os.getpid()]
    environs = {pid: _environ(pid) for pid in pids}
    ours = {pid for pid, environ in environs.items() if wanted in environ}
    raylets = {f"RAY_RAYLET_PID={pid}".encode() for pid in ours}
    ours |= {pid for pid, environ in environs.items() if raylets.intersection(environ)}
    # And their descendants: Ray retitles its agents (setproctitle), which writes over the
    # environment /proc shows, so an agent's marker can be gone; it is still a raylet's child.
    parents = {pid: _parent(pid) for pid in pids}
    while more := {pid for pid, parent in parents.items() if parent in ours and pid not in ours}:
        ours |= more
    return sorted(ours)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # ended


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; its parent reaps it


def stop_local_cluster(marker: str, grace_s: float = 10.0) -> list[int]:
    """End the cluster's processes: SIGTERM, then SIGKILL what is left after `grace_s`. Returns
    the ids of those still running (none, normally)."""
    pids = cluster_processes(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if _running(p)]
        if not pids:
            shutil.rmtree(marker, ignore_errors=True)  # the cluster's temporary directory
            break
    return pids
