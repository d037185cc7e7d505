"""`nowait fleet up CONFIG` on a local cluster it starts itself, with `fleet.direct_ingress` (the
gateway replica serves HTTP on its own port; the proxy path is tests/test_fleet_serve.py's) and
with `fleet.throughput_optimized` (that, and gRPC between the gateway and two engine replicas, one
of them killed under load), `fleet status --json` in the issue's shape, and `fleet down`, after
which none of that cluster's processes is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from nowait.fleet.cluster import cluster_processes
from tests.gateway_support import API_KEY, free_port, requests_with_a_kill, save_tiny_models

pytest.importorskip("ray")


def nowait(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nowait.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def listener_pid(port: int) -> int | None:
    """The process listening on TCP `port` (Linux /proc): the socket's inode, then whose fd it is."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
            except OSError:
                continue
    return None


def chat(url: str, i: int, stream: bool, max_tokens: int) -> int:
    """One chat request (streamed as server-sent events, or not): its answer's completion tokens."""
    body = {"model": "ar", "messages": [{"role": "user", "content": f"Name: {i}"}], "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if not stream:
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["completion_tokens"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["usage"]["completion_tokens"]


def kill_one_replica_under_load(url: str, pid: int) -> list[str]:
    """40 requests at concurrency 8 (a third streamed), the replica `pid` SIGKILLed once 10 are
    answered: the errors the clients saw."""
    _, errors = requests_with_a_kill(lambda i: chat(url, i, i % 3 == 0, 32), 40, 10,
                                     lambda: os.kill(pid, signal.SIGKILL))
    return errors


@pytest.mark.parametrize("mode", ["direct_ingress", "throughput_optimized", "placement_gateway"])
def test_fleet_up_status_down(tmp_path, codec, mode):
    models = save_tiny_models(tmp_path / "models", codec)
    port = free_port()
    replicas = 2 if mode == "throughput_optimized" else 1  # gRPC's replica death is tested with a second one left
    # placement: gateway: the engine runs inside the (direct-ingress) gateway replica, no deployment of its own.
    engine_fleet = ({"cpus_per_replica": 0.5, "placement": "gateway"} if mode == "placement_gateway"
                    else {"cpus_per_replica": 0.5, "replicas": {"min": replicas, "max": replicas}})
    switch = "direct_ingress" if mode == "placement_gateway" else mode
    # The replicas' niceness: the default (0, not Ray's 15) in two modes, a chosen one in the third.
    niceness = 3 if mode == "throughput_optimized" else 0
    config = {"auth": {"api_keys": [API_KEY], "api_keys_env": None}, "data_dir": str(tmp_path / "data"),
              "engines": {"ar": {"kind": "ar", "model": models["ar"], "max_num_seqs": 4,
                                 "fleet": engine_fleet}},
              "routing": {"fast_engine": None}, "defaults": {"max_tokens": 4},
              "fleet": {"port": port, switch: True, **({"worker_niceness": niceness} if niceness else {})}}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "NOWAIT_FLEET_STATE": str(tmp_path / "state.json"), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}  # passed on to Serve: nothing to drain here
    up = nowait("fleet", "up", str(tmp_path / "fleet.yaml"), "--num-cpus", "1", env=env)
    state = json.loads((tmp_path / "state.json").read_text()) if up.returncode == 0 else {}
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        marker = state["local_cluster"]
        assert cluster_processes(marker)  # the cluster's processes carry its marker
        status = nowait("fleet", "status", "--json", env=env)
        assert status.returncode == 0, status.stderr[-2000:]
        report = json.loads(status.stdout)
        assert set(report) == {"engines", "gateway_replicas", "url", "urls"}
        assert report["gateway_replicas"] == 1 and report["urls"] == [report["url"]] == [state["url"]]
        assert f"serving at {report['url']}" in up.stdout
        direct = urlsplit(report["url"])
        assert direct.hostname == "127.0.0.1" and direct.port != port  # the replica's own port, not the proxy's
        # Ignored, the option would leave this port to the proxy (or to nothing): it is the gateway
        # replica's own socket, in that cluster.
        gateway = listener_pid(direct.port)
        assert gateway in cluster_processes(marker)
        assert b"gateway" in Path(f"/proc/{gateway}/cmdline").read_bytes()
        answer = httpx.post(f"{report['url']}/v1/chat/completions", timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"model": "ar", "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        [engine] = report["engines"]
        assert engine["name"] == "ar" and len(engine["replicas"]) == replicas
        assert set(engine["replicas"][0]) == {"id", "node", "pid", "state", "running", "waiting", "niceness"}
        assert {r["state"] for r in engine["replicas"]} == {"RUNNING"}
        assert [r["niceness"] for r in engine["replicas"]] == [niceness] * replicas
        assert [os.getpriority(os.PRIO_PROCESS, r["pid"]) for r in engine["replicas"]] == [niceness] * replicas
        assert "warning" not in up.stderr  # they run at what the config asked for
        assert engine["placement"] == ("gateway" if mode == "placement_gateway" else "replicas")
        if mode == "placement_gateway":  # the engine's replica is the gateway replica's process itself
            assert engine["replicas"][0]["pid"] == gateway
        if mode == "throughput_optimized":
            environ = Path(f"/proc/{engine['replicas'][0]['pid']}/environ").read_bytes().split(b"\0")
            assert b"RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in environ  # Ray's switch reached the engine replica
            assert chat(report["url"], 0, True, 6) == 6  # a stream over gRPC
            # Every request answered. Whether the gateway's own retry counts one depends on where the
            # loss surfaced: over gRPC Ray's router re-sends a request the dead replica had not yet
            # accepted itself (seen both ways on this machine), so the count is not asserted here.
            assert kill_one_replica_under_load(report["url"], engine["replicas"][0]["pid"]) == []
    finally:
        if state:
            down = nowait("fleet", "down", env=env)
            assert down.returncode == 0, down.stderr[-2000:]
    assert cluster_processes(state["local_cluster"]) == []  # no Ray process of that cluster is left
    assert not (tmp_path / "state.json").exists()


def test_fleet_up_refuses_a_missing_checkpoint_in_one_line_before_ray_starts(tmp_path, codec, monkeypatch):
    from typer.testing import CliRunner

    from nowait.cli import app

    models = save_tiny_models(tmp_path / "models", codec)
    (tmp_path / "no-weights").mkdir()
    for name in ("config.json", "tokenizer.json"):  # all but the weights
        (tmp_path / "no-weights" / name).write_text((tmp_path / "models" / "ar" / name).read_text())
    config = {"engines": {"ar": {"kind": "ar", "model": str(tmp_path / "absent")},
                          "spec": {"kind": "spec", "model": models["ar"], "draft": str(tmp_path / "no-weights")}},
              "routing": {"fast_engine": None}, "data_dir": str(tmp_path / "data")}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("NOWAIT_FLEET_STATE", str(tmp_path / "state.json"))
    def no_ray(*args):  # the local cluster's start must not be reached
        raise AssertionError("a Ray cluster would start")

    monkeypatch.setattr("nowait.fleet.cluster.start_local_cluster", no_ray)
    up = CliRunner().invoke(app, ["fleet", "up", str(tmp_path / "fleet.yaml")])
    assert up.exit_code == 2, up.output
    [line] = up.output.strip().splitlines()  # one line, naming each engine's bad checkpoint
    assert "engine 'ar' model:" in line and "absent: no such checkpoint directory" in line
    assert "engine 'spec' draft:" in line and "missing model.safetensors" in line
    assert not (tmp_path / "state.json").exists()  # no fleet was started
