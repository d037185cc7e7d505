"""Injected engine faults: a step that raises fails the requests in it with 500 `engine_error`
(or, for a fast engine, re-runs them on its fallback engine), and no others: requests still
queued are served; the engine's thread keeps serving and /readyz counts the failure, names it and
says when; a truncated checkpoint at start leaves that engine unavailable with one line naming
the file, while the others serve."""

from __future__ import annotations

import shutil
import threading
import time

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
    assert abs(ready["last_failure_at"] - time.time()) < 3600  # unix seconds, not some other clock


def hold_intake_until(worker, count: int, monkeypatch) -> None:
    """The engine's thread takes its inbox only once `count` requests wait in it, so they enter
    the engine together (then one can be in a step while another queues behind it)."""
    intake, waited = worker._intake, []

    def held() -> None:
        deadline = time.monotonic() + 60  # a test that fails early does not hang the thread
        while not waited and len(worker._inbox) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        waited.append(True)
        intake()

    monkeypatch.setattr(worker, "_intake", held)


def side_by_side(send, count: int) -> list[httpx.Response]:
    answers: list = [None] * count

    def run(i: int) -> None:
        answers[i] = send()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return answers


def test_a_step_that_raises_fails_only_the_requests_in_it(saved, monkeypatch):
    models, root = saved
    config = base_config(models, root / "alone-data", free_port())
    config["engines"]["ar"]["max_num_seqs"] = 1  # the second request queues behind the first
    with live_server(config) as server:
        worker = server.gateway.backends["ar"].worker
        prefill, raised = worker.engine._run_prefill, []

        def failing_once(batch):
            if not raised:  # after the scheduler admitted the first request: it is in this step
                raised.append([s.seq_id for s in batch.seqs])
                raise RuntimeError("simulated prefill failure")
            return prefill(batch)

        monkeypatch.setattr(worker.engine, "_run_prefill", failing_once)
        hold_intake_until(worker, 2, monkeypatch)
        answers = side_by_side(lambda: complete(server, "ar"), 2)
    assert len(raised) == 1 and len(raised[0]) == 1
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 500], [a.text for a in answers]
    failed = next(a for a in answers if a.status_code == 500).json()["error"]
    assert failed["code"] == "engine_error" and "simulated prefill failure" in failed["message"]


def test_a_fast_engine_step_that_raises_falls_back_and_spares_the_queue(saved, monkeypatch):
    models, root = saved
    config = base_config(models, root / "fallback-data", free_port())
    config["engines"]["diffusion"]["max_batch"] = 1  # one request a wave: the second waits for the next
    with live_server(config) as server:
        worker = server.gateway.backends["diffusion"].worker
        generate, raised = worker.engine.generate, []

        def failing_once(requests):
            if not raised:
                raised.append(len(requests))
                raise RuntimeError("simulated wave failure")
            return generate(requests)

        monkeypatch.setattr(worker.engine, "generate", failing_once)
        hold_intake_until(worker, 2, monkeypatch)
        answers = side_by_side(lambda: complete(server, "diffusion"), 2)
        ready = httpx.get(f"{server.base_url}/readyz").json()["engines"]["diffusion"]
    assert raised == [1]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    tried = sorted([t["engine"] for t in a.json()["nowait"]["engines_tried"]] for a in answers)
    assert tried == [["diffusion"], ["diffusion", "ar"]]  # the failed one re-ran on AR; the queued one did not fail
    assert ready["available"] and ready["failures"] == 1 and "simulated wave failure" in ready["last_failure"]


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
