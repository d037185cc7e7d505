"""The fleet's parts that need no Ray cluster: its config, the deployment options, the replica
order the request router picks, an engine replica's health check, and that `nowait serve` and
`nowait demo` never import Ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nowait.engines.config import ArEngineConfig
from nowait.gateway.config import ConfigError, parse_config
from nowait.gateway.domain import Attempt, Call, Metadata
from nowait.router import DataClass
from tests.gateway_support import save_tiny_models


def test_serve_and_demo_never_import_ray():
    code = ("import sys; from typer.testing import CliRunner; from nowait.cli import app; "
            "runner = CliRunner(); "
            "assert runner.invoke(app, ['serve', '--help']).exit_code == 0; "
            "assert runner.invoke(app, ['demo', '--help']).exit_code == 0; "
            "assert runner.invoke(app, ['fleet', '--help']).exit_code == 0; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_fleet_sections_parse_and_refuse_what_cannot_deploy():
    config = parse_config({"engines": {"ar": {"kind": "ar", "fleet": {"replicas": {"min": 1, "max": 4},
                                                                     "gpus_per_replica": 0.5,
                                                                     "target_ongoing_requests": 16}}},
                           "routing": {"fast_engine": None}, "fleet": {"port": 9000}})
    fleet = config.engines["ar"].fleet
    assert (fleet.replicas.min, fleet.replicas.max, fleet.gpus_per_replica) == (1, 4, 0.5)
    assert (config.fleet.gateway_replicas, config.fleet.port, config.fleet.ray_address) == (2, 9000, None)
    with pytest.raises(ConfigError, match=r"engines\.ar\.fleet\.replicas.*min \(3\) is more than replicas\.max"):
        parse_config({"engines": {"ar": {"kind": "ar", "fleet": {"replicas": {"min": 3, "max": 2}}}},
                      "routing": {"fast_engine": None}})
    with pytest.raises(ConfigError, match=r"engines\.ar\.fleet\.gpu_per_replica"):
        parse_config({"engines": {"ar": {"kind": "ar", "fleet": {"gpu_per_replica": 1}}},
                      "routing": {"fast_engine": None}})


def test_worker_niceness_reaches_the_local_clusters_raylet_and_niced_replicas_are_named(monkeypatch):
    from nowait.fleet import cluster
    from nowait.fleet.cli import niced_replicas

    plain = parse_config({"routing": {"fast_engine": None}, "engines": {"ar": {"kind": "ar"}}})
    assert plain.fleet.worker_niceness == 0
    with pytest.raises(ConfigError, match=r"fleet\.worker_niceness"):
        parse_config({"engines": {"ar": {"kind": "ar"}}, "routing": {"fast_engine": None},
                      "fleet": {"worker_niceness": 20}})
    started = []
    monkeypatch.setattr(cluster.subprocess, "run", lambda command, env, **_: started.append(env) or
                        subprocess.CompletedProcess(command, 0, "", ""))
    cluster.start_local_cluster(worker_niceness=7)
    cluster.start_local_cluster()
    assert [env["RAY_worker_niceness"] for env in started] == ["7", "0"]  # Ray's own default would be 15
    report = {"engines": [{"name": "ar", "replicas": [{"id": "a", "niceness": 15}, {"id": "b", "niceness": 0},
                                                      {"id": "c", "niceness": None}]}]}  # c: still starting
    assert niced_replicas(report, 0) == {"a": 15} and niced_replicas(report, 15) == {}


def test_deployment_options_follow_the_fleet_section():
    from nowait.fleet.deploy import engine_options, gateway_replicas

    fixed = engine_options(ArEngineConfig(kind="ar", max_num_seqs=8, max_queue=4,
                                          fleet={"replicas": {"min": 2, "max": 2}, "cpus_per_replica": 0.5}))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert fixed["max_ongoing_requests"] == 8 + 4 + 1  # the replica answers its own 429
    scaled = engine_options(ArEngineConfig(kind="ar", fleet={"replicas": {"min": 1, "max": 3},
                                                             "target_ongoing_requests": 12}))
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 12}
    assert engine_options(ArEngineConfig(kind="ar"))["num_replicas"] == 1  # no fleet section: one replica
    sqlite = parse_config({"routing": {"fast_engine": None}, "engines": {"ar": {"kind": "ar"}}})
    assert gateway_replicas(sqlite) == 1  # an embedded store is one process's
    shared = parse_config({"routing": {"fast_engine": None}, "engines": {"ar": {"kind": "ar"}},
                           "store": {"url": "postgresql://u:p@db/nowait"}, "fleet": {"gateway_replicas": 3}})
    assert gateway_replicas(shared) == 3


def test_an_engine_replica_leaves_a_core_to_its_event_loop():
    from nowait.fleet.deploy import engine_replica_threads, fleet_application

    def threads(fleet: dict, server: dict | None = None) -> int:
        config = parse_config({"routing": {"fast_engine": None}, "server": server or {},
                               "engines": {"ar": {"kind": "ar", "fleet": fleet}}})
        return engine_replica_threads(config, config.engines["ar"])

    assert [threads({"cpus_per_replica": c}) for c in (0.5, 1, 2, 8)] == [1, 1, 1, 7]
    assert threads({"cpus_per_replica": 2}, {"reserved_cores": 0}) == 2 and threads({}, {"torch_threads": 3}) == 3
    config = parse_config({"routing": {"fast_engine": None}, "engines": {"ar": {"kind": "ar",
                                                                                "fleet": {"cpus_per_replica": 4}}}})
    engine = fleet_application(config)._bound_deployment.init_args[1]["ar"]._bound_deployment
    assert engine.init_args[-1] == 3  # what the replica's constructor sets torch to


def test_direct_ingress_reaches_the_controller_and_the_gateway_replicas_only_and_throughput_every_replica(monkeypatch):
    from nowait.fleet.deploy import direct_ingress_env, direct_urls, engine_env, fleet_application

    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "32000")  # Ray's own tuning, passed on
    monkeypatch.setenv("RAY_SERVE_OTHER", "1")
    base = {"routing": {"fast_engine": None}, "engines": {"ar": {"kind": "ar"}}}
    config = parse_config({**base, "fleet": {"direct_ingress": True}})
    env = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "32000"}
    assert direct_ingress_env(config) == env
    gateway = fleet_application(config)._bound_deployment
    assert gateway.ray_actor_options == {"num_cpus": 0, "runtime_env": {"env_vars": env}}
    engine = gateway.init_args[1]["ar"]._bound_deployment
    assert "runtime_env" not in engine.ray_actor_options  # an engine replica is no ingress
    assert direct_ingress_env(parse_config(base)) is None
    plain = fleet_application(parse_config(base))._bound_deployment
    assert plain.ray_actor_options == {"num_cpus": 0}
    fast = parse_config({**base, "fleet": {"throughput_optimized": True}})  # direct ingress included
    switch = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    assert direct_ingress_env(fast) == {**env, **switch} and engine_env(fast) == switch
    gateway = fleet_application(fast)._bound_deployment
    assert gateway.ray_actor_options["runtime_env"] == {"env_vars": {**env, **switch}}
    engine = gateway.init_args[1]["ar"]._bound_deployment
    assert engine.ray_actor_options["runtime_env"] == {"env_vars": switch}  # gRPC's server side, one loop
    assert engine_env(config) == {}
    proxy = {"app_name": "", "ingress_deployment_name": "", "protocol": "HTTP",
             "targets": [{"ip": "10.0.0.1", "port": 8000}]}
    ingress = {"app_name": "nowait", "ingress_deployment_name": "gateway", "protocol": "HTTP",
               "targets": [{"ip": "10.0.0.2", "port": 30001}, {"ip": "10.0.0.3", "port": 30000}]}
    grpc = {**ingress, "protocol": "gRPC", "targets": [{"ip": "10.0.0.2", "port": 40000}]}
    details = {"http_options": {"host": "0.0.0.0"}, "target_groups": [proxy, ingress, grpc]}
    assert direct_urls(details) == ["http://10.0.0.2:30001", "http://10.0.0.3:30000"]  # a wildcard: the node's
    assert direct_urls({**details, "http_options": {"host": "127.0.0.1"}}) == ["http://127.0.0.1:30000",
                                                                                "http://127.0.0.1:30001"]
    assert direct_urls({**details, "target_groups": [proxy]}) == []  # Serve without direct ingress


def test_router_prefers_the_least_loaded_and_the_affine_replica_when_close():
    from nowait.fleet.router import preference, replica_load

    assert replica_load({"running": 3, "waiting": 2}, None) == 5
    assert replica_load({"running": 1, "waiting": 0}, 4, None) == 4  # a newer count of requests sent since
    loads = {"a": 5, "b": 1, "c": 3}
    assert preference(loads, None, 2) == ["b", "c", "a"]
    assert preference(loads, "c", 2) == ["c", "b", "a"]  # within the slack: its cache likely holds the prefix
    assert preference(loads, "a", 2) == ["b", "c", "a"]  # too loaded: the shorter queue wins
    assert preference(loads, "gone", 2) == ["b", "c", "a"]
    ties = {tuple(preference({"a": 1, "b": 1}, None, 2)) for _ in range(50)}
    assert ties == {("a", "b"), ("b", "a")}  # equal replicas share the work


def test_affinity_key_is_the_prompt_beginning():
    from nowait.fleet.backend import affinity_key

    def chat(text: str) -> Call:
        return Call("r", "chat", "ar", Metadata(None, 1.0, DataClass.internal, False),
                    messages=[{"role": "system", "content": "x" * 300}, {"role": "user", "content": text}])

    assert affinity_key(chat("one")) == affinity_key(chat("two"))  # the same long system prompt
    assert affinity_key(chat("one")) != affinity_key(Call("r", "completions", "ar", chat("one").meta, prompt="y"))


def test_an_engine_placed_in_the_gateway_is_no_deployment_and_its_resources_are_the_gateways():
    from nowait.fleet.deploy import colocated_replicas, fleet_application
    from nowait.fleet.ingress import colocated_engine_names, colocated_torch_threads

    engines = {"diffusion": {"kind": "diffusion", "fleet": {"placement": "gateway", "cpus_per_replica": 2,
                                                            "gpus_per_replica": 0.5}},
               "spec": {"kind": "spec", "draft": "draft", "fleet": {"placement": "gateway", "cpus_per_replica": 3}},
               "ar": {"kind": "ar", "fleet": {"replicas": {"min": 2, "max": 2}}}}
    config = parse_config({"engines": engines})
    assert colocated_engine_names(config) == ["diffusion", "spec"]
    gateway = fleet_application(config)._bound_deployment
    assert gateway.ray_actor_options == {"num_cpus": 5, "num_gpus": 0.5}  # what its own engines hold
    assert set(gateway.init_args[1]) == {"ar"}  # the only engine reached through a handle
    assert colocated_torch_threads(config) == 2  # 5 CPUs, one reserved, shared by two engines
    assert colocated_torch_threads(parse_config({"engines": engines, "server": {"torch_threads": 4}})) is None
    only_replicas = parse_config({"engines": {"ar": engines["ar"]}, "routing": {"fast_engine": None}})
    assert colocated_torch_threads(only_replicas) is None
    with pytest.raises(ConfigError, match="replicas has no effect with placement: gateway"):
        parse_config({"engines": {"ar": {"kind": "ar", "fleet": {"placement": "gateway",
                                                                 "replicas": {"min": 2, "max": 2}}}},
                      "routing": {"fast_engine": None}})
    rows = [{"id": "g1", "pid": 11, "state": "RUNNING", "load": {"diffusion": {"running": 1, "waiting": 0},
                                                                   "spec": {"running": 0, "waiting": 2}}},
            {"id": "g2", "pid": 12, "state": "STARTING", "load": {}}]
    placed = colocated_replicas(rows)
    assert {k: [(r["id"], r["pid"], r["load"]["running"], r["placement"]) for r in v] for k, v in placed.items()} == {
        "diffusion": [("g1", 11, 1, "gateway")], "spec": [("g1", 11, 0, "gateway")]}


def test_a_gateway_replica_runs_its_own_engine_and_fails_its_health_check_when_it_died(tmp_path, codec):
    from nowait.fleet.ingress import GatewayIngress

    models = save_tiny_models(tmp_path, codec)
    config = parse_config({"engines": {"ar": {"kind": "ar", "model": models["ar"], "max_num_seqs": 2,
                                              "fleet": {"placement": "gateway"}}},
                           "routing": {"fast_engine": None}, "data_dir": str(tmp_path / "data")})
    replica = GatewayIngress.__mro__[1](config, {})  # the class under Serve's ASGI wrapper (serve.ingress)
    backend = replica.owned_backend("ar", config.engines["ar"])
    assert type(backend).__name__ == "OwnedBackend" and replica.colocated == {"ar": backend}
    assert replica.record_routing_stats() == {"ar": {"running": 0, "waiting": 0, "free_cache": 2, "pid": os.getpid(),
                                                     "niceness": os.getpriority(os.PRIO_PROCESS, 0)}}
    backend.worker.start()
    replica.check_health()  # serving
    backend.worker.stop()
    with pytest.raises(RuntimeError, match="engine 'ar': its worker thread has stopped"):
        replica.check_health()


def test_an_engine_replica_whose_thread_died_fails_its_health_check(tmp_path, codec):
    from nowait.fleet.replica import EngineReplica

    models = save_tiny_models(tmp_path, codec)
    import torch

    before = torch.get_num_threads()
    try:
        replica = EngineReplica("ar", ArEngineConfig(kind="ar", model=models["ar"], max_num_seqs=2), 60.0, 8,
                                torch_threads=before + 1)  # not what torch had: the call must have set it
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)
    replica.check_health()  # serving
    assert replica.load() == {"running": 0, "waiting": 0, "free_cache": 2, "served": 0, "pid": os.getpid(),
                              "niceness": os.getpriority(os.PRIO_PROCESS, 0)}
    replica.backend.worker.stop()
    with pytest.raises(RuntimeError, match="worker thread has stopped"):
        replica.check_health()


def test_an_engine_replica_streams_few_objects_and_counts_its_own_totals(tmp_path, codec, monkeypatch):
    import asyncio

    from nowait.fleet import deltas
    from nowait.fleet.replica import EngineReplica
    from nowait.gateway.domain import Sampling

    monkeypatch.setattr(deltas, "GROUP_WINDOW_S", 60.0)  # every delta after the first held to the end
    models = save_tiny_models(tmp_path, codec)
    replica = EngineReplica("ar", ArEngineConfig(kind="ar", model=models["ar"], max_num_seqs=2), 60.0, 8)
    call = Call("r", "chat", "ar", Metadata(None, 1.0, DataClass.internal, False), sampling=Sampling(max_tokens=8),
                messages=[{"role": "user", "content": "Name: Ann"}])

    async def both():
        replies = [reply async for reply in replica.stream(call, 30.0)]
        return replies, await replica.run(call, 30.0)

    try:
        replies, unary = asyncio.run(both())
    finally:
        replica.backend.worker.stop()
    kinds = [r.kind for r in replies]
    assert kinds == ["open", "delta", "done"], kinds  # not one object per token
    assert replies[1].text + replies[2].text == unary.attempt.text  # greedy: the same answer
    assert unary.attempt.completion_tokens > 2
    totals = replica.totals()
    assert totals["requests"] == 2 and totals["generation_tokens"] == 2 * unary.attempt.completion_tokens
    assert totals["replica"] == replica.id and totals["busy_seconds"] > 0


def test_a_stream_resumed_on_another_replica_skips_what_the_client_has():
    from types import SimpleNamespace

    from nowait.fleet.backend import FleetStream, replayable
    from nowait.gateway.domain import Sampling
    from nowait.gateway.errors import APIError

    def call(**sampling) -> Call:
        return Call("r", "chat", "ar", Metadata(None, 1.0, DataClass.internal, False), sampling=Sampling(**sampling),
                    messages=[{"role": "user", "content": "x"}])

    assert replayable(call()) and replayable(call(temperature=0.0)) and replayable(call(temperature=0.8, seed=3))
    assert not replayable(call(temperature=0.8))  # another replica would sample another answer
    stream = FleetStream(SimpleNamespace(name="ar", in_flight=1), call(), 10.0, replies=None)
    stream.sent, stream.again = "Hello wor", ""
    assert stream._caught_up("Hel") == ""  # the client has it already
    assert stream._caught_up("lo w") == ""
    assert stream._caught_up("orld!") == "ld!"  # from where the client is
    assert stream.again is None  # caught up: later deltas pass as they come
    stream.sent, stream.again = "Hello", ""
    with pytest.raises(APIError, match="differs from what was sent"):
        stream._caught_up("Help")


def test_replica_totals_reach_the_metrics_with_a_replica_label():
    from types import SimpleNamespace

    from nowait.gateway.engine_stats import EngineStats
    from nowait.gateway.metrics import GatewayMetrics
    from nowait.router import RoutingPolicy

    def totals(requests: int, tokens: int, busy_s: float, running: int = 0) -> dict:
        return {"requests": requests, "generation_tokens": tokens, "busy_seconds": busy_s, "cost_usd": busy_s / 10,
                "running": running, "waiting": 0}

    metrics = GatewayMetrics()
    backend = SimpleNamespace(name="ar", available=True, running=lambda: 0, waiting=lambda: 0,
                              stats=EngineStats(60.0, 1.0), replica_retries=1,
                              replica_totals={"r1": totals(2, 10, 0.5), "r2": totals(1, 4, 0.25)})
    policy = RoutingPolicy(owned_engines=("ar",), batch_engine="ar", fast_engine=None, fallback_engine="ar",
                           owned_frontier_engine="ar")
    metrics.refresh([backend], policy)
    backend.replica_totals = {"r1": totals(3, 15, 0.75, running=2), "r2": totals(1, 4, 0.25)}
    backend.replica_retries = 2
    metrics.refresh([backend], policy)  # counters take what was added since the last scrape
    text = metrics.render().decode()
    assert 'nowait:replica_requests_total{engine="ar",replica="r1"} 3.0' in text
    assert 'nowait:replica_generation_tokens_total{engine="ar",replica="r2"} 4.0' in text
    assert 'nowait:replica_busy_seconds_total{engine="ar",replica="r1"} 0.75' in text
    assert 'nowait:replica_cost_usd_total{engine="ar",replica="r1"} 0.075' in text
    assert 'nowait:replica_num_requests_running{engine="ar",replica="r1"} 2.0' in text
    assert 'nowait:replica_retries_total{engine="ar"} 2.0' in text
    # Another gateway replica scraped later reads the same replica totals: its counters equal these.
    other = GatewayMetrics()
    other.refresh([backend], policy)
    assert 'nowait:replica_requests_total{engine="ar",replica="r1"} 3.0' in other.render().decode()


def test_stream_deltas_go_in_groups_the_first_at_once_the_rest_held_until_the_end_or_the_window():
    import asyncio

    from nowait.fleet.deltas import grouped

    async def scenario(window_s: float) -> list[tuple[str, bool]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def deltas():
            while (text := await queue.get()) is not None:
                if isinstance(text, Exception):
                    raise text
                yield text

        out = grouped(deltas(), window_s)
        got = []
        await queue.put("He")
        got.append(await anext(out))  # the first delta at once, alone
        for text in ("l", "lo", " wo"):
            await queue.put(text)
        await asyncio.sleep(0.01)
        if window_s == 0:  # no window: the next send takes what arrived since
            got.append(await anext(out))
        await queue.put("rld")
        await queue.put(None)
        got.extend([item async for item in out])
        return got

    assert asyncio.run(scenario(60.0)) == [("He", False), ("llo world", True)]  # held until the stream ended
    assert asyncio.run(scenario(0.0)) == [("He", False), ("llo wo", False), ("rld", True)]

    async def failing() -> list:
        async def deltas():
            yield "a"
            yield "b"
            raise RuntimeError("engine failed")

        return [item async for item in grouped(deltas(), 60.0)]

    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(failing())


class _LostStreams:
    """A FleetBackend's side of a stream whose replica dies after `before_loss`; a retry gets `after`."""

    name = "ar"

    def __init__(self, after: list[str]) -> None:
        self.in_flight, self.replica_retries, self.after = 1, 0, after

    def _retrying(self, error: BaseException) -> None:
        self.replica_retries += 1

    async def _open(self, call, timeout_s):
        from nowait.fleet.replies import Reply

        async def replies():
            for text in self.after:
                yield Reply("delta", text=text)
            yield Reply("done", attempt=Attempt("ar", text="".join(self.after)), replica="r2")

        return replies(), Reply("open", replica="r2")

    def _answered(self, reply):
        return reply.attempt


async def _lost_after(texts: list[str]):
    from ray.exceptions import ActorDiedError

    from nowait.fleet.replies import Reply

    for text in texts:
        yield Reply("delta", text=text)
    raise ActorDiedError()


def _stream_through_a_lost_replica(temperature: float | None, after: list[str]) -> tuple[list[str], _LostStreams]:
    import asyncio

    from nowait.fleet.backend import FleetStream
    from nowait.gateway.domain import Sampling

    backend = _LostStreams(after)
    call = Call("r", "chat", "ar", Metadata(None, 1.0, DataClass.internal, False),
                sampling=Sampling(temperature=temperature), messages=[{"role": "user", "content": "x"}])
    stream = FleetStream(backend, call, 10.0, _lost_after(["Hel", "lo"]))
    got: list[str] = []

    async def read() -> None:
        async for text in stream.deltas():
            got.append(text)

    try:
        asyncio.run(read())
    finally:
        assert backend.in_flight == 0  # its place is given back however the stream ends
    return got, backend


def test_a_greedy_stream_whose_replica_died_resumes_where_the_client_is():
    got, backend = _stream_through_a_lost_replica(None, ["Hello", " world"])
    assert got == ["Hel", "lo", " world"] and backend.replica_retries == 1


def test_a_sampled_stream_whose_replica_died_ends_with_an_error():
    from nowait.gateway.errors import APIError

    with pytest.raises(APIError) as lost:
        _stream_through_a_lost_replica(0.8, ["Hello", " world"])
    assert lost.value.code == "replica_lost" and lost.value.status == 502


def test_a_cluster_process_whose_environment_was_rewritten_is_still_found_by_its_parent(tmp_path):
    """Ray retitles its agents, which overwrites the environment /proc shows: `fleet down` finds
    them as the children of the cluster's processes (an agent otherwise outlived `fleet down`)."""
    import os
    import time
    from pathlib import Path

    from nowait.fleet.cluster import MARKER, cluster_processes

    marker = str(tmp_path / "cluster")
    # The parent carries the marker; its child starts with an empty environment (`env -i`).
    parent = subprocess.Popen(["bash", "-c", "env -i sleep 60 & wait"], env={MARKER: marker, "PATH": os.defpath})
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(cluster_processes(marker)) < 2:
            time.sleep(0.05)
        found = cluster_processes(marker)
        assert parent.pid in found and len(found) == 2
        child = next(pid for pid in found if pid != parent.pid)
        assert MARKER.encode() not in Path(f"/proc/{child}/environ").read_bytes()  # found by its parent alone
    finally:
        for pid in cluster_processes(marker):
            os.kill(pid, 9)
        parent.wait()
