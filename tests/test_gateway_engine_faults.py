"""Injected engine faults: a step that raises fails its requests with 500 `engine_error`, the
engine's thread keeps serving the next request and /readyz counts the failure and names it; a
truncated checkpoint at start leaves that engine unavailable with one line naming the file,
while the others serve."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.gateway_support import API_KEY, base_config, free_port, live_server, save_tiny_models

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("engine-faults")
    return save_tiny_models(root / "models", codec), root


def complete(server, model: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": model, "prompt": "Name:", "max_tokens": 3})


def test_a_step_that_raises_fails_its_request_and_the_engine_serves_on(saved, monkeypatch):
    models, root = saved
    with live_server(base_config(models, root / "step-data", free_port())) as server:
        engine = server.gateway.backends["ar"].worker.engine
        step = engine.step
        raised: list[int] = []

        def failing_once():
            if not raised:
                raised.append(1)
                raise RuntimeError("simulated step failure")
            return step()

        monkeypatch.setattr(engine, "step", failing_once)
        failed = complete(server, "ar")
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error", failed.text
        served = complete(server, "ar")
        assert served.status_code == 200, served.text
        ready = httpx.get(f"{server.base_url}/readyz").json()["engines"]["ar"]
    assert raised == [1]
    assert ready["available"] and ready["failures"] == 1
    assert "simulated step failure" in ready["last_failure"]


def test_a_truncated_checkpoint_leaves_its_engine_unavailable_and_the_others_serve(saved):
    models, root = saved
    broken = root / "broken-diffusion"
    shutil.copytree(models["diffusion"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with live_server(base_config({**models, "diffusion": str(broken)}, root / "broken-data", free_port())) as server:
        ready = httpx.get(f"{server.base_url}/readyz").json()["engines"]
        served = complete(server, "ar")
        refused = complete(server, "diffusion")
    assert not ready["diffusion"]["available"]
    reason = ready["diffusion"]["reason"]
    assert "model.safetensors" in reason and "\n" not in reason
    assert ready["ar"]["available"] and served.status_code == 200
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
