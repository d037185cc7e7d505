"""Batch-1 latency of `nowait serve` and of a fleet taking turns: `nowait bench load` (synchronous,
one request at a time) against each target in turn, streamed and not, for some rounds; per run the
p50s, the load average before it, and the CPU milliseconds per request its target's processes
spent (the serve process; every process of the fleet's local cluster, less their idle rate just
before), which a loaded machine stretches less than wall time.

    nowait serve --config serve.yaml &                          # port 18101
    NOWAIT_FLEET_STATE=fleet.json nowait fleet up fleet.yaml    # fleet.direct_ingress: true
    python scripts/fleet_latency_ab.py --serve-url http://127.0.0.1:18101 --serve-pid PID \
        --fleet direct=fleet.json --rounds 3 --json-out ab.json

docs/fleet.md, "What the fleet path adds per request", has the numbers and the configs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nowait.fleet.cluster import cluster_processes

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
        except OSError:
            pass  # ended
    return total


def bench(url: str, stream: bool, requests: int, max_tokens: int) -> dict:
    command = [sys.executable, "-m", "nowait.cli", "bench", "load", "--base-url", url, "--model", "ar", "--no-schema",
               "--max-tokens", str(max_tokens), "--profile", "synchronous", "--max-requests", str(requests), "--json"]
    if not stream:
        command.append("--no-stream")
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def p50s(report: dict) -> dict[str, float]:
    """TTFT, ITL and e2e p50 (ms) of the run."""
    [run] = report["runs"]
    return {key: run[key]["p50"] for key in ("ttft_ms", "itl_ms", "e2e_ms") if run.get(key)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-url", required=True)
    parser.add_argument("--serve-pid", type=int, required=True)
    parser.add_argument("--fleet", action="append", required=True, metavar="NAME=STATE",
                        help="a fleet to measure, by its state file (NOWAIT_FLEET_STATE); repeat for several")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    targets = {"serve": (args.serve_url, lambda: [args.serve_pid])}
    for named in args.fleet:
        name, path = named.split("=", 1)
        state = json.loads(Path(path).read_text())
        targets[name] = (state["url"], lambda marker=state["local_cluster"]: cluster_processes(marker))
    rows = []
    for round_ in range(1, args.rounds + 1):
        for stream in (True, False):
            for name, (url, pids) in targets.items():
                load = Path("/proc/loadavg").read_text().split()[0]
                watched = pids()
                idle_start, idle_cpu = time.perf_counter(), cpu_seconds(watched)
                time.sleep(args.idle_s)  # what the processes spend with nothing to answer (Ray's own polling)
                before, started = cpu_seconds(watched), time.perf_counter()
                idle_rate = (before - idle_cpu) / (started - idle_start)
                report = bench(url, stream, args.requests, args.max_tokens)
                spent = cpu_seconds(watched) - before - idle_rate * (time.perf_counter() - started)
                cpu_ms = spent * 1000 / args.requests  # its warm-up request included
                row = {"round": round_, "target": name, "stream": stream, "load": float(load),
                       "cpu_ms_per_request": round(cpu_ms, 1), "p50": p50s(report)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    for stream in (True, False):
        for name in targets:
            picked = [r for r in rows if r["target"] == name and r["stream"] == stream]
            keys = sorted(picked[0]["p50"])
            print(name, "stream" if stream else "no-stream",
                  {k: [r["p50"][k] for r in picked] for k in keys},
                  "cpu ms/request", statistics.median(r["cpu_ms_per_request"] for r in picked))


if __name__ == "__main__":
    main()
