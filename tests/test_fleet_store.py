"""Two gateway replicas of a fleet on one PostgreSQL store: a 200-line batch completes, each line
answered once, while one gateway replica is killed mid-batch (its leased lines are taken over by
the other once their lease expires)."""

from __future__ import annotations

import io
import json
import os
import time

import openai
import pytest

from nowait.gateway.config import parse_config
from tests.gateway_support import API_KEY, base_config, free_port, save_tiny_models

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _patient(call, deadline: float):
    """A client call retried while the proxy still routes to the killed gateway replica."""
    while True:
        try:
            return call()
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_batch_completes_once_while_a_gateway_replica_is_killed(tmp_path, codec, postgres_url):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from nowait.fleet.deploy import GATEWAY, deploy, shut_down
    from nowait.fleet.deploy import _serve_details as serve_details

    models = save_tiny_models(tmp_path / "models", codec)
    port = free_port()
    config = base_config(models, tmp_path / "data", port, routing={"fast_engine": None})
    config["engines"] = {"ar": {**config["engines"]["ar"], "fleet": {"cpus_per_replica": 1}}}
    config.update(fleet={"port": port, "gateway_replicas": 2}, store={"url": postgres_url, "lease_s": 3},
                  batches={"max_concurrent_lines": 8})
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        url = deploy(parse_config(config))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "ar", "messages": [{"role": "user", "content": f"Name: {i}"}], "max_tokens": 8}}
                 for i in range(200)]
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        batch_id = batch.id
        deadline = time.monotonic() + 180
        while batch.request_counts is None or batch.request_counts.completed < 20:
            batch = _patient(lambda: client.batches.retrieve(batch_id), deadline)
            time.sleep(0.05)
        assert batch.request_counts.completed < 200, "the batch ended before a gateway replica could be killed"
        gateways = serve_details()["applications"]["nowait"]["deployments"][GATEWAY]["replicas"]
        assert len(gateways) == 2
        ray.kill(ray.get_actor(gateways[0]["actor_name"], namespace="serve"))
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"the batch is stuck: {batch.request_counts}"
            time.sleep(0.3)
            batch = _patient(lambda: client.batches.retrieve(batch_id), deadline)
        assert batch.status == "completed" and batch.request_counts.completed == 200, batch.request_counts
        output = _patient(lambda: client.files.content(batch.output_file_id).text, deadline).splitlines()
        ids = [json.loads(line)["custom_id"] for line in output]
        assert len(ids) == 200 and set(ids) == {f"line-{i}" for i in range(200)}  # each line answered once
    finally:
        shut_down()
        ray.shutdown()
