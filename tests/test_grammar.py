"""Schema-constrained JSON through llguidance: valid by construction, the trained layout allowed."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from nowait import paths
from nowait.engines.ar.engine import AutoregressiveEngine
from nowait.engines.base import GenerationRequest, InvalidRequestError, SamplingParams
from nowait.engines.speculative import SpeculativeConfig, SpeculativeEngine
from nowait.engines.structured.grammar import GrammarCompiler
from nowait.extraction.corpus import KINDS, documents, schema_for
from nowait.tokenizer import TextCodec
from tests.conftest import build_model

# Bounded everywhere, so that even a random model finishes: enum, bounded integer, a pattern,
# a date, a short nullable string, a boolean, an unbounded-but-short-in-practice number.
SCHEMA = {
    "type": "object",
    "properties": {
        "account_type": {"type": "string", "enum": ["current", "savings", "business"]},
        "term_months": {"type": "integer", "minimum": 1, "maximum": 480},
        "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "issue_date": {"type": "string", "format": "date"},
        "note": {"type": ["string", "null"], "maxLength": 8},
        "active": {"type": "boolean"},
    },
    "required": ["account_type", "term_months", "currency", "issue_date", "note", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_file(paths.tokenizer_path())  # the project's own tokenizer.json


@pytest.fixture(scope="module")
def compiler(codec) -> GrammarCompiler:
    return GrammarCompiler.from_codec(codec)


@pytest.fixture(scope="module")
def model(codec):
    return build_model(0, vocab_size=codec.vocab_size)


def check_valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    return value


@pytest.mark.parametrize("kind", KINDS)
def test_the_trained_answer_layout_is_always_allowed(codec, compiler, kind):
    """Every token of the canonical answers the models are trained on passes the mask, so the
    grammar only removes what a trained model would not write."""
    docs = [d for d in documents("validation", 30) if d.kind == kind][:3]
    for doc in docs:
        matcher = compiler.matcher(schema_for(kind))
        for token in codec.encode(doc.answer_json()):
            assert matcher.allowed()[token], codec.decode([token])
            matcher.consume(token)
        assert matcher.is_accepting() and matcher.allowed()[codec.end_id]


def test_sampled_output_of_a_random_model_is_valid_for_the_schema(codec, compiler, model):
    engine = AutoregressiveEngine(model, codec, grammar=compiler)
    requests = [GenerationRequest(codec.encode(f"document {i}"), SamplingParams(max_tokens=120, temperature=1.2,
                                                                                  seed=i), schema=SCHEMA)
                for i in range(6)]
    for completion in engine.generate(requests):
        assert completion.finish_reason == "stop"
        check_valid(completion.text, SCHEMA)
        assert completion.timings.grammar_mask_s > 0  # the mask's cost is measured per request


def test_constrained_speculation_matches_constrained_ar(codec, compiler, model):
    prompts = [codec.encode(f"document {i}") for i in range(3)]

    def requests():
        return [GenerationRequest(p, SamplingParams(max_tokens=40), schema=SCHEMA) for p in prompts]

    reference = AutoregressiveEngine(model, codec, grammar=compiler).generate(requests())
    for method in ("ngram", "draft"):
        engine = SpeculativeEngine(model, codec, grammar=compiler, draft=build_model(1, vocab_size=codec.vocab_size),
                                   speculative=SpeculativeConfig(method=method, gamma=3))
        completions = [engine.generate([r])[0] for r in requests()]
        assert [c.token_ids for c in completions] == [c.token_ids for c in reference]
        assert sum(c.draft_tokens_proposed for c in completions) > 0
    # A drafted answer (here the constrained answer with its braces broken) is cut at the
    # grammar's first refusal, and the output is still the constrained target's.
    verify = SpeculativeEngine(model, codec, grammar=compiler, draft=build_model(1, vocab_size=codec.vocab_size),
                               speculative=SpeculativeConfig(method="ngram", gamma=8))
    for request, answer in zip(requests(), reference, strict=True):
        request.draft_ids = codec.encode("}}") + answer.token_ids
        [completion] = verify.generate([request])
        assert completion.token_ids == answer.token_ids and completion.draft_tokens_accepted > 0
    sampled = SpeculativeEngine(model, codec, grammar=compiler, draft=build_model(1, vocab_size=codec.vocab_size))
    for completion in sampled.generate([GenerationRequest(p, SamplingParams(max_tokens=120, temperature=1.0, seed=3),
                                                          schema=SCHEMA) for p in prompts]):
        assert completion.finish_reason == "stop"
        check_valid(completion.text, SCHEMA)


def test_masked_tokens_are_never_chosen(codec, compiler, model):
    """The grammar's mask is applied before the choice: every emitted token was allowed."""
    engine = AutoregressiveEngine(model, codec, grammar=compiler)
    completion = engine.generate([GenerationRequest(codec.encode("x"), SamplingParams(max_tokens=120),
                                                    schema=SCHEMA)])[0]
    matcher = compiler.matcher(SCHEMA)
    for token in completion.token_ids:
        assert matcher.allowed()[token]
        matcher.consume(token)
    assert matcher.is_accepting()


def test_a_bad_schema_is_a_clear_error(codec, compiler, model):
    engine = AutoregressiveEngine(model, codec, grammar=compiler)
    with pytest.raises(InvalidRequestError, match="schema"):
        engine.generate([GenerationRequest([1, 2], schema={"type": "no-such-type"})])


def test_mask_unpacking_matches_the_library(compiler):
    """One bit per token in llguidance's little-endian words, read back as a bool vector."""
    matcher = compiler.matcher({"type": "boolean"})
    allowed = matcher.allowed()
    assert allowed.dtype == torch.bool and allowed.shape == (compiler.vocab_size,)
    assert 0 < int(allowed.sum()) < 20  # "t", "f", "true", ... only
