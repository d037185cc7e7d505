"""Where a fleet request's time goes, counted rather than timed: CPU milliseconds and context
switches per request in each process of a local fleet (`nowait fleet up`, its cluster found by
its marker) and of a `nowait serve` beside it, less each process's idle rate. A loaded machine
stretches wall times far more than it stretches CPU time, so these compare across runs.

    nowait serve --config serve.yaml &                # port 18101
    NOWAIT_FLEET_STATE=fleet.json nowait fleet up fleet1.yaml
    python scripts/fleet_cpu_per_request.py --state fleet.json --serve-pid PID --serve-port 18101 \
        --fleet-port 18102 --requests 30

docs/fleet.md, "What the fleet path adds per request", has the numbers and the configs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from nowait.fleet.cluster import cluster_processes

ROLES = ("ServeReplica:nowait:gateway", "ServeReplica:nowait:engine", "ProxyActor", "ServeController", "raylet",
         "gcs_server", "log_monitor", "DashboardAgent")
TICK = os.sysconf("SC_CLK_TCK")


def role(pid: int, serve_pid: int) -> str:
    if pid == serve_pid:
        return "nowait serve"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return "?"
    return next((name for name in ROLES if name in command), command[:40])


def sample(pids: list[int]) -> dict[int, tuple[float, int]]:
    """Each process's CPU seconds (user + system) and context switches (all its threads)."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            switches = 0
            for task in os.listdir(f"/proc/{pid}/task"):
                for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
                    if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                        switches += int(line.split()[1])
            out[pid] = ((int(fields[11]) + int(fields[12])) / TICK, switches)
        except OSError:
            pass  # ended
    return out


def per_request(pids: list[int], send: Callable[[], object], requests: int, idle: dict[int, tuple[float, float]],
                serve_pid: int) -> tuple[float, dict[str, tuple[float, float]]]:
    send()  # warm
    before, started = sample(pids), time.perf_counter()
    for _ in range(requests):
        send()
    after, elapsed = sample(pids), time.perf_counter() - started
    rows: dict[str, list[float]] = {}
    for pid, (cpu, switches) in after.items():
        if pid not in before:
            continue
        idle_cpu, idle_switches = idle.get(pid, (0.0, 0.0))
        row = rows.setdefault(role(pid, serve_pid), [0.0, 0.0])
        row[0] += (cpu - before[pid][0] - idle_cpu * elapsed) * 1e3 / requests
        row[1] += (switches - before[pid][1] - idle_switches * elapsed) / requests
    return elapsed * 1e3 / requests, {name: (cpu, sw) for name, (cpu, sw) in rows.items() if cpu > 0.1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", required=True, help="the fleet's state file (NOWAIT_FLEET_STATE)")
    parser.add_argument("--serve-pid", type=int, required=True)
    parser.add_argument("--serve-port", type=int, default=18101)
    parser.add_argument("--fleet-port", type=int, default=18102)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--idle-s", type=float, default=5.0)
    args = parser.parse_args()
    pids = [*cluster_processes(json.loads(Path(args.state).read_text())["local_cluster"]), args.serve_pid]
    before, started = sample(pids), time.perf_counter()
    time.sleep(args.idle_s)
    after, elapsed = sample(pids), time.perf_counter() - started
    idle = {p: ((after[p][0] - before[p][0]) / elapsed, (after[p][1] - before[p][1]) / elapsed)
            for p in after if p in before}
    body = {"model": "ar", "messages": [{"role": "user", "content": "Name: Ann"}], "max_tokens": 8}
    cases: dict[str, Callable[[httpx.Client], object]] = {
        "GET /v1/models": lambda c: c.get("/v1/models"),
        "chat 8 tokens": lambda c: c.post("/v1/chat/completions", json=body),
        "chat 8 tokens, streamed": lambda c: c.post("/v1/chat/completions", json={**body, "stream": True}).read(),
        "chat 64 tokens, streamed": lambda c: c.post("/v1/chat/completions",
                                                     json={**body, "max_tokens": 64, "stream": True}).read()}
    print(f"load average {Path('/proc/loadavg').read_text().split()[0]}")
    for target, port in (("serve", args.serve_port), ("fleet", args.fleet_port)):
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        for case, send in cases.items():
            wall_ms, rows = per_request(pids, lambda send=send, client=client: send(client), args.requests, idle,
                                        args.serve_pid)
            ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])
            print(f"{target} {case} ({wall_ms:.1f} ms wall/request): "
                  + "; ".join(f"{name} {cpu:.1f} CPU ms, {sw:.0f} switches" for name, (cpu, sw) in ranked))
    print(f"load average {Path('/proc/loadavg').read_text().split()[0]}")


if __name__ == "__main__":
    main()
