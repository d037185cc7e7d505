"""The fleet on one local Ray cluster (module-scoped, 2 CPUs, no dashboard): the official openai
client against the fleet app as against `nowait serve` (chat, stream, json_schema, batch,
errors); two AR replicas both serving under concurrency 8; one of them killed mid-way through
100 requests: every request answered, the retry counted, the replica back."""

from __future__ import annotations

import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nowait.gateway.config import parse_config
from tests.gateway_support import (
    API_KEY,
    SMALL_SCHEMA,
    base_config,
    free_port,
    requests_with_a_kill,
    save_tiny_models,
)

ray = pytest.importorskip("ray")  # the `fleet` extra; the README's test command installs it

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, codec):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from nowait.fleet.deploy import deploy, shut_down

    root = tmp_path_factory.mktemp("fleet")
    models = save_tiny_models(root / "models", codec)
    port = free_port()
    config = base_config(models, root / "data", port, routing={"fast_engine": None, "confidence_threshold": 0.0})
    config["engines"] = {"ar": {**config["engines"]["ar"], "max_queue": 64,
                                "fleet": {"replicas": {"min": 2, "max": 2}, "cpus_per_replica": 0.5,
                                          "gpus_per_replica": 0.5}}}
    config["fleet"] = {"port": port}
    # One logical GPU (no device behind it): the replicas' gpus_per_replica must be placed on it.
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        url = deploy(parse_config(config))
        yield url
    finally:
        shut_down()
        ray.shutdown()


def client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=kwargs.pop("api_key", API_KEY), max_retries=0, timeout=60,
                         **kwargs)


def ar_replicas() -> list[dict]:
    from nowait.fleet.deploy import engine_replicas

    return engine_replicas()["ar"]


def metric_lines(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_openai_client_suite_against_the_fleet(fleet):
    c = client(fleet)
    chat = c.chat.completions.create(model="ar", messages=[{"role": "user", "content": "Name: Ann"}], max_tokens=6)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    pieces = [chunk.choices[0].delta.content or "" for chunk in
              c.chat.completions.create(model="ar", messages=[{"role": "user", "content": "Name: Ann"}], max_tokens=6,
                                        stream=True) if chunk.choices]
    assert pieces and "".join(pieces) == chat.choices[0].message.content  # greedy: the same answer, streamed
    shaped = c.chat.completions.create(model="ar", messages=[{"role": "user", "content": "kind?"}], max_tokens=24,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "doc", "schema": SMALL_SCHEMA, "strict": True}})
    assert set(json.loads(shaped.choices[0].message.content)) == {"kind", "ok"}
    with pytest.raises(openai.NotFoundError) as missing:
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:  # refused by the replica's engine, answered as serve does
        c.chat.completions.create(model="ar", messages=[{"role": "user", "content": "x"}], max_tokens=100_000)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        client(fleet, api_key="sk-wrong").models.list()
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "ar", "messages": [{"role": "user", "content": f"Name: {i}"}], "max_tokens": 4}}
             for i in range(5)]
    uploaded = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                              purpose="batch")
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = c.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 5
    answered = [json.loads(line) for line in c.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(a["custom_id"] for a in answered) == [f"line-{i}" for i in range(5)]


def _ask(url: str, i: int, stream: bool, max_tokens: int = 12) -> str:
    c = client(url)
    messages = [{"role": "user", "content": f"Name: {i}"}]
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in
                       c.chat.completions.create(model="ar", messages=messages, max_tokens=max_tokens, stream=True)
                       if chunk.choices)
    return c.chat.completions.create(model="ar", messages=messages,
                                     max_tokens=max_tokens).choices[0].message.content


def test_replicas_hold_the_resources_their_fleet_section_names(fleet):
    from nowait.fleet.deploy import fleet_status

    status = fleet_status()  # without fleet.direct_ingress, clients use the proxy's URL
    assert status["url"] == fleet and status["urls"] == [fleet]
    assert ray.cluster_resources()["GPU"] == 1
    assert ray.available_resources().get("GPU", 0) == 0  # two replicas x gpus_per_replica 0.5


def test_two_ar_replicas_both_serve_under_concurrency(fleet):
    before = {r["id"]: r["load"].get("served", 0) for r in ar_replicas()}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(fleet, i, i % 2 == 0), range(32)))
    assert len(answers) == 32
    after = {r["id"]: r["load"].get("served", 0) for r in ar_replicas()}
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after), (before, after)
    # One request sent to the engine's deployment by another caller, as a second gateway replica
    # would: the replicas count it, so this gateway's /metrics shows it too.
    from ray import serve

    from nowait.gateway.domain import Call, Metadata, Sampling
    from nowait.router import DataClass

    other = serve.get_deployment_handle("engine-ar", "nowait").options(method_name="run")
    elsewhere = other.remote(Call("elsewhere", "chat", "ar", Metadata(None, 1.0, DataClass.internal, False),
                                  sampling=Sampling(max_tokens=5), messages=[{"role": "user", "content": "Name: Bo"}]),
                             30.0).result(timeout_s=60).attempt
    scraped = metric_lines(fleet)
    for replica in after:  # every replica's numbers reach /metrics under its own label
        assert scraped[f'nowait:replica_requests_total{{engine="ar",replica="{replica}"}}'] >= 1
    per_replica = sum(v for k, v in scraped.items() if k.startswith("nowait:replica_generation_tokens_total{"))
    # The engine's tokens are its replicas' sum: this gateway's own and the other caller's.
    assert per_replica == scraped['nowait:generation_tokens_total{engine="ar"}'] + elsewhere.completion_tokens
    cost = sum(v for k, v in scraped.items() if k.startswith("nowait:replica_cost_usd_total{"))
    assert cost == pytest.approx(scraped['nowait:cost_usd_total{engine="ar"}'] + elsewhere.cost_usd)


def test_a_replica_killed_mid_way_loses_no_request(fleet):
    victim = ar_replicas()[0]

    def kill() -> None:
        actor = ray.get_actor(victim["actor_name"], namespace="serve")
        while not ray.get(actor.record_routing_stats.remote())["running"]:  # killed with requests on it
            time.sleep(0.005)
        ray.kill(actor)

    done, errors = requests_with_a_kill(lambda i: _ask(fleet, i, i % 3 == 0, max_tokens=64), 100, 30, kill)
    assert errors == [] and len(done) == 100
    assert metric_lines(fleet)['nowait:replica_retries_total{engine="ar"}'] >= 1  # a request was on it
    deadline = time.monotonic() + 90  # Ray replaces the dead replica
    while time.monotonic() < deadline:
        replicas = ar_replicas()
        if sum(r["state"] == "RUNNING" for r in replicas) == 2 and victim["id"] not in {r["id"] for r in replicas}:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the killed replica was not replaced: {ar_replicas()}")
