"""Template infilling: slot languages, the token automaton, and JSON valid for every schema."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest

from nowait.engines.base import GenerationRequest, InvalidRequestError, SamplingParams
from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.structured.byte_dfa import compile_language
from nowait.engines.structured.languages import PatternError, json_string_pattern, literal, parse_regex, seq
from nowait.engines.structured.templates import SchemaTemplateError, TemplateCompiler
from nowait.engines.structured.token_automaton import SlotAutomaton
from nowait.extraction.corpus import KINDS, schema_for

from .conftest import build_model


@pytest.mark.parametrize(("pattern", "texts"), [
    (r"^[A-Z]{2}$", ["NG", "ng", "NGA", "", "N"]),
    (r"^\+[0-9]{6,15}$", ["+123456", "+12345", "+1234567890123456", "123456"]),
    (r"ab|cd", ["ab", "xxcdyy", "ac", ""]),
    (r"^(?:a|bc)+x?$", ["a", "abca", "bcx", "x", "ab"]),
    (r"^\d{2}-\w\s?[^a-c]$", ["12-z d", "12-_e", "12-zz", "1x-zd", "12-z a"]),
    (r"^é.$", ["éa", "éé", "ea", "é"]),
    (r"^a{2,}b{,1}$", ["aa", "aaab", "ab", "aabb"]),
    (r"^[\x41-\x5A]{3}$", ["ABC", "A-Z", "-AA", "abc", "AZZ"]),  # escaped range ends are ranges
    (r"^[\.-9]+$", [".", "/09", "9", "a", "-"]),
    (r"^[a\-z]$", ["a", "-", "z", "b"]),
    (r"^[\u0041-Z]$", ["A", "Q", "Z", "-", "a"]),
])
def test_patterns_agree_with_python_re(pattern, texts):
    language = compile_language(seq(literal('"'), json_string_pattern(pattern), literal('"')))
    for text in texts:
        assert language.matches(json.dumps(text, ensure_ascii=False).encode()) == bool(re.search(pattern, text)), text


@pytest.mark.parametrize("pattern", [r"(?=a)b", r"(a)\1", r"\bword", r"a*+", r"[a-", r"(ab", r"[\d-z]",
                                     r"^\ud83d\ude00$", r"[\u00C0-\u017F]"])
def test_unsupported_patterns_are_refused(pattern):
    with pytest.raises(PatternError):
        json_string_pattern(pattern)


def test_allowed_tokens_equal_brute_force():
    """On a toy vocabulary, a token is allowed at a position exactly when some completion of the
    slot (value, then end tokens) with that token there is in the language."""
    end, mask = 0, 1
    vocabulary = [None, None, b"1", b"2", b"-", b"12", b"0", b"-1", b"x"]
    width = 3
    language = parse_regex(r"-?(0|[1-9][0-9]*)")
    automaton = SlotAutomaton(compile_language(language), vocabulary, end, width)
    dfa = compile_language(language)
    tokens = [t for t in range(len(vocabulary)) if t != mask]

    def valid(sequence):
        if end in sequence:
            first = sequence.index(end)
            if any(t != end for t in sequence[first:]):
                return False
            sequence = sequence[:first]
        return bool(sequence) and dfa.matches(b"".join(vocabulary[t] for t in sequence))

    for assigned in itertools.product([None, end, 2, 4, 5], repeat=width):
        free = [i for i, t in enumerate(assigned) if t is None]
        masks = automaton.allowed(list(assigned), free)
        completions = [c for c in itertools.product(tokens, repeat=len(free))
                       if valid([dict(zip(free, c, strict=True)).get(i, t) for i, t in enumerate(assigned)])]
        assert automaton.completable(list(assigned)) == bool(completions)
        for k, position in enumerate(free):
            expected = {c[k] for c in completions}
            assert set(masks[position].nonzero()[0].tolist()) == expected, (assigned, position)


CUSTOM_SCHEMAS = [
    {"type": "object", "properties": {
        "count": {"type": "integer"}, "ratio": {"type": ["number", "null"]}, "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "note": {"type": "string", "maxLength": 4},
        "level": {"enum": [1, 2.5, "high", True, None]}, "fixed": {"const": "v1"},
        "when": {"type": ["string", "null"], "format": "date"}, "nothing": {"type": "null"},
    }},
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "x-nowait-slot-tokens": 6}},
     "required": ["name"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine(codec):
    model = build_model(vocab_size=codec.vocab_size, causal=False, logits_shift=True, mask_token_id=codec.mask_id)
    return DiffusionEngine(model, codec)


@pytest.mark.parametrize("schema", [schema_for(kind) for kind in KINDS] + CUSTOM_SCHEMAS)
def test_template_output_parses_and_validates_for_every_schema(engine, codec, schema):
    prompt = codec.encode("Extract the fields as JSON.")
    requests = [
        GenerationRequest(prompt, SamplingParams(max_tokens=512), schema=schema),
        GenerationRequest(prompt, SamplingParams(max_tokens=512, temperature=1.0, seed=3), schema=schema,
                          options={"policy": "factor", "cache": "prompt"}),
        GenerationRequest(prompt, SamplingParams(max_tokens=512, temperature=0.7, seed=4), schema=schema,
                          options={"tau": 0.5, "block": 16}),
    ]
    for completion in engine.generate(requests):
        value = json.loads(completion.text)
        jsonschema.validate(value, schema)
        assert list(value) == list(schema["properties"])
        assert completion.finish_reason == "stop"
        assert len(completion.token_confidences) == len(completion.token_ids)
        assert 0.0 <= completion.confidence <= 1.0
        # Usage counts the answer as the tokenizer writes it, not the template's separately tokenized pieces.
        assert completion.completion_tokens == len(codec.encode(completion.text))


def test_template_fixed_text_is_untouched_and_only_slots_are_generated(engine, codec):
    schema = schema_for("kyc")
    [completion] = engine.generate([GenerationRequest(codec.encode("KYC form"), SamplingParams(max_tokens=512),
                                                      schema=schema)])
    template = engine.compiler.compile(schema).template
    at = 0
    for piece in template.pieces:  # the fixed text, in order, around the values
        at = completion.text.index(piece, at) + len(piece)
    assert completion.text.startswith(template.pieces[0]) and at == len(completion.text)
    fixed = len(template.ids) - len(template.slot_positions)
    # Fixed tokens are given, so they carry confidence 1; the overall confidence is the weakest
    # generated decision.
    assert sum(p == 1.0 for p in completion.token_confidences) >= fixed
    assert completion.confidence <= min(completion.token_confidences)


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "object", "properties": {"a": {"type": "object"}}}, "scalar"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}}, "minimum"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}, "not supported"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[0-9]{30}$", "x-nowait-slot-tokens": 4}}},
     "no valid value fits"),
    ({"type": "object", "properties": {"a": {"enum": [{"x": 1}]}}}, "scalars"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "anyOf": []}, "anyOf"),
    ({"type": "array", "items": {"type": "string"}}, "object schema"),
])
def test_schemas_a_template_cannot_express_are_refused(codec, engine, schema, fragment):
    with pytest.raises(SchemaTemplateError, match=fragment):
        TemplateCompiler(codec, codec.mask_id).compile(schema)
    with pytest.raises(InvalidRequestError, match="schema: .*" + fragment):
        engine.generate([GenerationRequest([5, 6], SamplingParams(max_tokens=512), schema=schema)])


def test_a_date_slot_holds_real_dates_only():
    import datetime

    from nowait.engines.structured.templates import ISO_DATE

    language = compile_language(ISO_DATE)
    for text in ["2024-02-29", "2000-02-29", "2023-02-28", "2023-12-31", "2023-04-30", "1996-02-29",
                 "2023-02-29", "1900-02-29", "2023-04-31", "2023-02-31", "2023-13-01", "2023-00-10", "2023-01-32"]:
        try:
            datetime.date.fromisoformat(text)
            real = True
        except ValueError:
            real = False
        assert language.matches(json.dumps(text).encode()) == real, text


def test_enum_options_are_narrowed_by_the_other_keywords(codec):
    from nowait.engines.structured.templates import value_language

    narrowed = compile_language(value_language("a", {"type": "string", "enum": ["abc", "abcdefgh"], "maxLength": 4},
                                               100))
    assert narrowed.matches(b'"abc"') and not narrowed.matches(b'"abcdefgh"')
    with pytest.raises(SchemaTemplateError, match="no enum option"):
        value_language("a", {"const": "ab", "pattern": "^x"}, 100)


@pytest.mark.parametrize(("properties", "fragment"), [
    ({"a": {"type": "string", "minLength": 5, "maxLength": 3}}, "minLength 5 > maxLength 3"),
    ({"a": {"enum": []}}, "cannot be laid out"),
    ({"a": {"type": "string", "x-nowait-slot-tokens": "abc"}}, "cannot be laid out"),
    ({"a": {"enum": [float("nan")]}}, "NaN"),
    ({"a": {"type": "string", "format": "date", "pattern": "^2"}}, "format: date together"),
    ({"a": {"type": "string", "x-nowait-slot-tokens": 10**6}}, "more than max_tokens"),
])
def test_schemas_that_would_break_the_promise_are_refused_clearly(codec, engine, properties, fragment):
    schema = {"type": "object", "properties": properties}
    built = dict(engine.compiler._automata)
    with pytest.raises(InvalidRequestError, match="schema: .*" + re.escape(fragment)):
        engine.generate([GenerationRequest([5, 6], SamplingParams(max_tokens=512), schema=schema)])
    assert engine.compiler._automata == built  # refused before a slot automaton was built


def test_the_template_keeps_the_property_order_it_was_given(codec):
    compiler = TemplateCompiler(codec, codec.mask_id)
    first = compiler.compile({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}})
    second = compiler.compile({"type": "object", "properties": {"b": {"type": "null"}, "a": {"type": "boolean"}}})
    assert [s.name for s in first.template.slots] == ["a", "b"]
    assert [s.name for s in second.template.slots] == ["b", "a"]
