"""On fallback, the fast engine's answer travels to the fallback engine as a draft to verify.

A speculative fallback engine (kind spec) turns the text into `draft_ids` in its own tokens and
verifies it instead of drafting; every other engine leaves it alone. The answer is still the
fallback model's own (tests/test_speculative.py checks that for any draft)."""

from __future__ import annotations

import asyncio

import pytest

from nowait.gateway.dispatch import Dispatcher
from nowait.gateway.domain import Attempt, Call, Metadata, Sampling
from nowait.gateway.ledger import AuditLog
from nowait.gateway.metrics import GatewayMetrics
from nowait.gateway.owned import OwnedBackend
from nowait.router import DataClass, RoutingPolicy


class RecordingBackend:
    """A backend answering with fixed text and confidence, keeping every Call it runs."""

    owned, available, unavailable_reason, stats = True, True, "", None

    def __init__(self, name: str, text: str, confidence: float | None) -> None:
        self.name, self.kind, self.text, self.confidence = name, name, text, confidence
        self.calls: list[Call] = []

    def may_receive(self, data_class) -> bool:
        return True

    async def run(self, call: Call, timeout_s: float) -> Attempt:
        self.calls.append(call)
        return Attempt(engine=self.name, text=self.text, confidence=self.confidence, completion_tokens=3)


def call(model: str, temperature: float | None = None) -> Call:
    meta = Metadata(latency_budget_ms=None, token_value_usd_per_mtok=0.0, data_class=DataClass.internal,
                    batchable=False)
    return Call("req-1", "chat", model, meta, sampling=Sampling(temperature=temperature, seed=7),
                messages=[{"role": "user", "content": "Name: Ann Lee"}])


def spec_fallback_dispatcher(tmp_path, fast: RecordingBackend) -> tuple[Dispatcher, dict[str, RecordingBackend]]:
    """A dispatcher whose policy comes from a config saying `routing.fallback_engine: spec`, with a
    backend of its own under each engine name: a re-run that went to `ar` instead of `spec` is
    seen as such, not hidden behind one backend answering for both names."""
    from nowait.gateway.config import parse_config

    policy = parse_config({"routing": {"fallback_engine": "spec", "confidence_threshold": 0.9}}).routing_policy()
    engines = {"diffusion": fast, "spec": RecordingBackend("spec", '{"name": "Ann Lee"}', None),
               "ar": RecordingBackend("ar", '{"name": "Ann Lee"}', None)}
    return Dispatcher(engines, policy, "nowait", GatewayMetrics(), AuditLog(tmp_path / "audit.jsonl"),
                      timeout_s=5), engines


@pytest.mark.parametrize(("confidence", "falls_back"), [(0.2, True), (0.999, False)])
def test_the_fast_answer_is_the_fallback_engines_draft(tmp_path, confidence, falls_back):
    """A low-confidence answer re-runs on the configured fallback engine (spec), carrying the
    fast engine's text as its draft; the other owned engine (ar) is not asked."""
    fast = RecordingBackend("diffusion", '{"name": "Ann Lee"}', confidence)
    dispatcher, engines = spec_fallback_dispatcher(tmp_path, fast)
    outcome = asyncio.run(dispatcher.complete(call("diffusion")))
    assert fast.calls[0].draft_text is None
    assert not engines["ar"].calls
    if falls_back:
        assert outcome.fallback and [a.engine for a in outcome.attempts] == ["diffusion", "spec"]
        [retry] = engines["spec"].calls
        assert retry.draft_text == fast.text
        assert retry.messages == fast.calls[0].messages and retry.request_id == "req-1"
    else:
        assert not outcome.fallback and not engines["spec"].calls


def test_a_sampled_fallback_gets_no_draft(tmp_path):
    """A seeded sampled answer shares its seed with the re-run, so it is not an independent draft:
    the configured fallback engine (spec, not ar) re-runs it without one."""
    dispatcher, engines = spec_fallback_dispatcher(tmp_path, RecordingBackend("diffusion", '{"name": "Ann Lee"}', 0.2))
    outcome = asyncio.run(dispatcher.complete(call("diffusion", temperature=0.8)))
    assert outcome.fallback and outcome.final.engine == "spec" and not engines["ar"].calls
    assert engines["spec"].calls[0].draft_text is None


@pytest.mark.parametrize("kind", ["spec", "ar", "diffusion"])
def test_only_a_speculative_engine_turns_the_draft_into_ids(codec, kind):
    worker = type("Idle", (), {"stats": None})()  # generation_request never reaches the worker
    backend = OwnedBackend("engine", kind, worker, codec, max_model_len=400, capacity=1, max_queue=1,
                           node_usd_per_hour=1.0, default_max_tokens=16)
    with_draft = call("engine")
    with_draft.draft_text = '{"name": "Ann Lee"}'
    request = backend.generation_request(with_draft)
    assert request.draft_ids == (codec.encode(with_draft.draft_text) if kind == "spec" else None)
    assert backend.generation_request(call("engine")).draft_ids is None


class FailingBackend(RecordingBackend):
    def __init__(self, name: str, error) -> None:
        super().__init__(name, "", None)
        self.error = error

    async def run(self, call: Call, timeout_s: float) -> Attempt:
        self.calls.append(call)
        raise self.error


@pytest.mark.parametrize(("status", "code", "falls_back"), [
    (500, "engine_error", True), (429, "rate_limit_exceeded", True), (503, "engine_unavailable", True),
    (504, "timeout", False)])
def test_a_fast_engine_that_cannot_answer_hands_over_to_its_fallback(tmp_path, status, code, falls_back):
    """A client asked for an answer, not for an engine: a failing, full or missing fast engine
    re-runs on the fallback engine; a timeout does not (its time is already spent)."""
    from nowait.gateway.errors import APIError

    fast = FailingBackend("diffusion", APIError(status, "simulated", code=code))
    slow = RecordingBackend("ar", '{"name": "Ann Lee"}', None)
    policy = RoutingPolicy(confidence_threshold=0.9, fallback_engine="ar")
    dispatcher = Dispatcher({"diffusion": fast, "ar": slow}, policy, "nowait", GatewayMetrics(),
                            AuditLog(tmp_path / "audit.jsonl"), timeout_s=5)
    if falls_back:
        outcome = asyncio.run(dispatcher.complete(call("nowait")))
        assert outcome.final.engine == "ar" and outcome.fallback_cause == "engine_failure"
    else:
        with pytest.raises(APIError):
            asyncio.run(dispatcher.complete(call("nowait")))
        assert not slow.calls


def test_the_stricter_data_class_of_header_and_body_holds():
    from nowait.gateway.calls import metadata
    from nowait.gateway.config import RequestDefaults
    from nowait.gateway.schemas import NowaitRequestOptions

    header = {"x-nowait-data-class": "restricted"}
    assert metadata(NowaitRequestOptions(data_class="public"), header, RequestDefaults()).data_class \
        == DataClass.restricted
    assert metadata(NowaitRequestOptions(data_class="restricted"), {"x-nowait-data-class": "public"},
                    RequestDefaults()).data_class == DataClass.restricted
    assert metadata(NowaitRequestOptions(data_class="internal"), {}, RequestDefaults()).data_class \
        == DataClass.internal


def test_an_answer_a_strict_json_parser_rejects_does_not_conform():
    from nowait.gateway.prompts import conforms

    schema = {"type": "object", "properties": {"a": {"type": "number"}}}
    assert conforms('{"a": 1.5}', schema)
    assert not conforms('{"a": NaN}', schema) and not conforms('{"a": Infinity}', None)
    assert not conforms('{"a": ', schema)
