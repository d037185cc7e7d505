"""schemathesis against the real app in process (its ASGI loader): every operation of the
OpenAPI document with generated requests, then the stateful phase that follows the document's
links (file -> batch -> output file). The engines are the tiny test checkpoints, so a case costs
milliseconds; routes, middleware and validation are the ones `nowait serve` runs.

Bounded here (a fixed seed, a few examples per operation); the long run for maintainers is in
docs/testing.md ("Fuzzing the API").
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from nowait.gateway.app import create_app
from nowait.gateway.config import parse_config
from tests.gateway_support import API_KEY, base_config, free_port, save_tiny_models

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# NOWAIT_FUZZ_EXAMPLES raises the bound for a longer run (docs/testing.md).
EXAMPLES = int(os.environ.get("NOWAIT_FUZZ_EXAMPLES", "12"))
STATEFUL_EXAMPLES = int(os.environ.get("NOWAIT_FUZZ_STATEFUL_EXAMPLES", "15"))
FUZZ_SETTINGS = dict(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def fresh_api_schema(tmp_path_factory, codec):
    root = tmp_path_factory.mktemp("fuzz")
    config = base_config(save_tiny_models(root / "models", codec), root / "data", free_port(),
                         defaults={"max_tokens": 4})
    app = create_app(parse_config(config))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory, codec):
    return fresh_api_schema(tmp_path_factory, codec)


@pytest.fixture
def empty_store_schema(tmp_path_factory, codec):
    """A server of its own: the stateful phase follows links from what its own calls created, so
    the hundreds of files the per-operation test leaves behind must not change its path."""
    return fresh_api_schema(tmp_path_factory, codec)


def test_every_operation_answers_as_documented(api_schema):
    # Each operation through hypothesis directly (schemathesis' pytest loader does not run
    # under pytest 9); every operation is run and every failing one named.
    failures, operations, sent = {}, 0, []
    for loaded in api_schema.get_all_operations():
        operation = loaded.ok()
        operations += 1

        @given(case=st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                              operation.as_strategy(GenerationMode.NEGATIVE)))
        @settings(max_examples=EXAMPLES, phases=[Phase.explicit, Phase.generate], **FUZZ_SETTINGS)
        def answers_as_documented(case):
            sent.append(case.operation.label)
            case.call_and_validate(headers=AUTH, checks=CHECKS)

        try:
            answers_as_documented()
        except (Exception, FailureGroup) as failure:  # every operation's failure is reported together
            failures[operation.label] = str(failure)[:2000]
    print(f"schemathesis: {len(sent)} generated cases over {operations} operations, {len(failures)} failing")
    assert operations >= 25 and len(set(sent)) == operations  # every operation was called
    assert not failures, "\n\n".join(f"{label}: {text}" for label, text in failures.items())


def test_files_batches_and_output_files_follow_their_links(empty_store_schema):
    machine = empty_store_schema.as_state_machine()
    answered: list[tuple[str, int]] = []

    class WithKey(machine):
        def before_call(self, case):
            case.headers = {**(case.headers or {}), **AUTH}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            answered.append((case.operation.label, response.status_code))
            case.validate_response(response, checks=CHECKS)

    WithKey.run(settings=settings(max_examples=STATEFUL_EXAMPLES, stateful_step_count=6, **FUZZ_SETTINGS))
    print(f"schemathesis stateful: {len(answered)} calls in {STATEFUL_EXAMPLES} scenarios")
    # A batch is only created from a real file id, which only the upload's link supplies; its
    # id reaches the batch operations only through the batch's links.
    assert ("POST /v1/batches", 200) in answered, sorted(set(answered))[:60]
    assert ("GET /v1/batches/{batch_id}", 200) in answered, sorted(set(answered))[:60]
