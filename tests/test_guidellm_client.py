"""guidellm 0.8.1, unchanged, against `nowait serve`: its default backend validation (`GET /health`,
vLLM's probe) passes, and a few requests in its default request format (streamed chat
completions), one at a time and two streams at once, all complete without an error. (Its
`request_format=/v1/responses` runs against nowait too; the Responses API's own tests use the
official client.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway_support import API_KEY, base_config, free_port, save_tiny_models

BIN = Path(sys.executable).parent
REQUESTS = 3


@pytest.fixture(scope="module")
def serve(tmp_path_factory, codec):
    """`nowait serve` in its own process, on a config of the tiny checkpoints."""
    root = tmp_path_factory.mktemp("guidellm")
    models = save_tiny_models(root / "models", codec)
    port = free_port()
    config = base_config(models, root / "data", port)
    del config["engines"]["frontier-api"]  # no upstream runs beside this server
    path = root / "nowait.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (root / "serve.log").open("w")
    server = subprocess.Popen([str(BIN / "nowait"), "serve", "--config", str(path), "--threads", "1",
                               "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (root / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "nowait serve did not start"
            time.sleep(0.2)
        yield base, models["ar"], root
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def answered(base: str, route: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f'nowait:gateway_request_latency_seconds_count{{route="{route}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("profile", ["kind=synchronous", "kind=concurrent,streams=2"])
def test_guidellm_run_completes_without_errors(serve, tmp_path, profile):
    base, checkpoint, _ = serve
    backend = f"kind=openai_http,target={base},model=ar,api_key={API_KEY}"
    before = answered(base, "ar")
    out = tmp_path / "guidellm.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(
        [str(BIN / "guidellm"), "run", "--backend", backend, "--profile", profile,
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", "kind=synthetic_text,prompt_tokens=24,output_tokens=6",
         "--tokenizer", f"kind=huggingface_auto,model={checkpoint}",  # the checkpoint's own tokenizer.json
         "--output", f"kind=json,path={out}", "--disable-console"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    totals = json.loads(out.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    assert answered(base, "ar") == before + REQUESTS  # every request went through the gateway
