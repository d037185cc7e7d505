"""JSON Schema -> an answer template for diffusion infilling.

The template holds the object's braces, keys, colons and commas as fixed tokens and one slot of
bounded width per property. A slot holds the property's JSON value (quotes included, or
`null`) followed by end tokens up to its width. A diffusion model unmasks only the slots, so the
structure is right by construction and each value is written in parallel with the others.
The demo diffusion model is trained on this layout (and on free-form JSON), so it has learned
to pad a slot with end tokens.

`compile_template` adds one `SlotAutomaton` per slot: the regular language of the JSON texts
valid for the property's schema (type, enum, const, pattern, length, date format), so the engine
can let only tokens that keep the slot completable into each masked position. The output is
then valid for the schema by construction, whatever the model proposes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from jsonschema import Draft202012Validator

from nowait.engines.structured.byte_dfa import compile_language
from nowait.engines.structured.languages import (
    Node,
    PatternError,
    alt,
    char_set,
    json_string_char,
    json_string_pattern,
    literal,
    parse_regex,
    rep,
    seq,
)
from nowait.engines.structured.token_automaton import SlotAutomaton, token_byte_strings
from nowait.tokenizer import TextCodec

# Slot widths in tokens. Under the demo tokenizer digits are single tokens, so a quoted ISO
# date takes 12; the longest string values of the corpus take 20.
SLOT_WIDTH_BY_TYPE = {"string": 24, "number": 12, "integer": 8, "boolean": 2, "null": 1}
DATE_SLOT_WIDTH = 12


class SchemaTemplateError(ValueError):
    """The schema cannot be laid out as a template (not an object of scalar properties)."""


@dataclass(frozen=True)
class Slot:
    name: str
    start: int  # index into Template.ids
    width: int


@dataclass(frozen=True)
class Template:
    """Answer token ids with `mask_id` in every slot position, and where the slots are."""

    ids: list[int]
    slots: list[Slot]
    pieces: list[str]  # the fixed text before each slot, then the closing text

    @property
    def slot_positions(self) -> list[int]:
        return [slot.start + i for slot in self.slots for i in range(slot.width)]


def _types(schema: dict) -> list[str]:
    value = schema.get("type", "string")
    return value if isinstance(value, list) else [value]


def slot_width(schema: dict, codec: TextCodec) -> int:
    """Tokens reserved for one property's value.

    An explicit `x-nowait-slot-tokens` wins; an enum (or const) takes its longest option; a
    date takes a quoted ISO date; `maxLength` bounds a string; otherwise a default per JSON
    type, widened so that `true`/`false`/`null` fit when the type allows them.
    """
    if "x-nowait-slot-tokens" in schema:
        return int(schema["x-nowait-slot-tokens"])
    if "enum" in schema or "const" in schema:
        options = schema["enum"] if "enum" in schema else [schema["const"]]
        return max(len(codec.encode(json.dumps(option, ensure_ascii=False))) for option in options)
    if schema.get("format") == "date":
        return DATE_SLOT_WIDTH
    types = [t for t in _types(schema) if t != "null"] or ["null"]
    if types == ["string"] and "maxLength" in schema:
        return int(schema["maxLength"]) + 2
    width = max(SLOT_WIDTH_BY_TYPE.get(t, SLOT_WIDTH_BY_TYPE["string"]) for t in types)
    literals = {"boolean": ("true", "false"), "null": ("null",)}
    for json_type in _types(schema):
        width = max([width] + [len(codec.encode(word)) for word in literals.get(json_type, ())])
    return width


def build_template(schema: dict, codec: TextCodec, mask_id: int) -> Template:
    """Lay out an object schema as fixed pieces and value slots, in property order."""
    if schema.get("type", "object") != "object" or not isinstance(schema.get("properties"), dict):
        raise SchemaTemplateError("template infilling needs an object schema with 'properties'")
    if not schema["properties"]:
        raise SchemaTemplateError("the schema has no properties to fill")
    ids: list[int] = []
    slots: list[Slot] = []
    pieces: list[str] = []
    for index, (name, property_schema) in enumerate(schema["properties"].items()):
        if not isinstance(property_schema, dict) or {"object", "array"} & set(_types(property_schema)):
            raise SchemaTemplateError(f"property {name!r}: template slots hold scalar values only")
        piece = ("{" if index == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        pieces.append(piece)
        ids.extend(codec.encode(piece))
        width = slot_width(property_schema, codec)
        slots.append(Slot(name=name, start=len(ids), width=width))
        ids.extend([mask_id] * width)
    pieces.append("}")
    ids.extend(codec.encode("}"))
    return Template(ids=ids, slots=slots, pieces=pieces)


def fill_template(template: Template, values: dict[str, object], codec: TextCodec) -> list[int] | None:
    """The template with every slot holding its value and end padding (a training target).

    None when a value does not fit its slot (training skips such a document in template mode).
    """
    ids = list(template.ids)
    for slot in template.slots:
        value_ids = codec.encode(json.dumps(values.get(slot.name), ensure_ascii=False))
        if len(value_ids) > slot.width:
            return None
        ids[slot.start: slot.start + slot.width] = value_ids + [codec.end_id] * (slot.width - len(value_ids))
    return ids


def read_template(template: Template, ids: list[int], codec: TextCodec) -> str:
    """The JSON text of a filled template: fixed pieces and slot values, end padding dropped."""
    parts = []
    for piece, slot in zip(template.pieces, template.slots, strict=False):
        parts.append(piece)
        value = [t for t in ids[slot.start: slot.start + slot.width] if t != codec.end_id]
        parts.append(codec.decode(value))
    parts.append(template.pieces[-1])
    return "".join(parts)


# --- slot languages: which JSON texts a property's value may be ---

NUMBER = parse_regex(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
INTEGER = parse_regex(r"-?(0|[1-9][0-9]*)")
BOOLEAN = alt(literal("true"), literal("false"))
NULL = literal("null")
QUOTE = literal('"')
# Unescaped characters or the short escapes; \\uXXXX is left out (a model has no need of it).
FREE_STRING = seq(QUOTE, rep(alt(json_string_char(), seq(literal("\\"), char_set('"\\/bfnrt'))), 0, None), QUOTE)
# RFC 3339 full-date, days per month, February 29 in leap years only (Gregorian: divisible by 4,
# not by 100 unless by 400).
ISO_DATE = seq(QUOTE, parse_regex(
    r"[0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    r"|02-(0[1-9]|1[0-9]|2[0-8]))"
    r"|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29"), QUOTE)

# Keywords that only describe; anything else a slot cannot enforce is refused, not ignored.
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
               "writeOnly", "$id", "$schema", "$anchor"}
SLOT_KEYWORDS = {"type", "enum", "const", "format", "pattern", "minLength", "maxLength", "x-nowait-slot-tokens"}
OBJECT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "unevaluatedProperties"}
JSON_TYPES = {"string", "number", "integer", "boolean", "null"}


def value_language(name: str, schema: dict, max_chars: int) -> Node:
    """The JSON texts a slot may hold for this property schema.

    `max_chars` bounds what the slot can physically hold; a `maxLength` above it needs no
    counting states. Raises SchemaTemplateError for a keyword or pattern a slot cannot enforce.
    """
    def refuse(why: str) -> SchemaTemplateError:
        return SchemaTemplateError(f"property {name!r}: {why}")

    unknown = sorted(k for k in schema if k not in SLOT_KEYWORDS | ANNOTATIONS and not k.startswith("x-"))
    if unknown:
        raise refuse(f"template slots cannot enforce {', '.join(map(repr, unknown))}")
    declared = schema.get("type")
    types = _types(schema) if declared is not None or not {"enum", "const"} & set(schema) else sorted(JSON_TYPES)
    if not set(types) <= JSON_TYPES:
        raise refuse(f"unsupported type {declared!r}")
    if "enum" in schema or "const" in schema:
        options = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(options, list) or any(isinstance(o, dict | list) for o in options):
            raise refuse("enum options must be scalars")
        if any(isinstance(o, float) and not math.isfinite(o) for o in options):
            raise refuse("enum options must be JSON values (NaN and infinities are not)")
        # The other keywords (type, pattern, lengths, format) narrow the options, as a validator reads them.
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const") and not k.startswith("x-")}
        checker = Draft202012Validator(rest, format_checker=Draft202012Validator.FORMAT_CHECKER)
        options = [o for o in options if checker.is_valid(o)]
        if not options:
            raise refuse("no enum option is valid for the property's other keywords")
        return alt(*(literal(json.dumps(o, ensure_ascii=False)) for o in options))
    branches = []
    for json_type in types:
        if json_type == "string":
            branches.append(_string_language(schema, max_chars, refuse))
        elif json_type == "number":
            branches.append(NUMBER)
        elif json_type == "integer":
            branches.append(INTEGER)
        elif json_type == "boolean":
            branches.append(BOOLEAN)
        else:
            branches.append(NULL)
    return branches[0] if len(branches) == 1 else alt(*branches)


def _string_language(schema: dict, max_chars: int, refuse) -> Node:
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    if high is not None and int(high) < low:
        raise refuse(f"minLength {low} > maxLength {high}: no string is valid")
    bounded = low > 0 or (high is not None and int(high) < max_chars)
    if schema.get("format") == "date" and ("pattern" in schema or "minLength" in schema or "maxLength" in schema):
        raise refuse("format: date together with pattern/minLength/maxLength is not supported")
    if "pattern" in schema:
        if bounded:
            raise refuse("a pattern together with minLength/maxLength is not supported")
        try:
            return seq(QUOTE, json_string_pattern(str(schema["pattern"])), QUOTE)
        except PatternError as error:
            raise refuse(str(error)) from None
    if bounded:
        # Counted in characters, as JSON Schema counts; escapes are left out here.
        return seq(QUOTE, rep(json_string_char(), low, None if high is None else int(high)), QUOTE)
    if schema.get("format") == "date":
        return ISO_DATE
    return FREE_STRING


@dataclass(frozen=True)
class ConstrainedTemplate:
    """A template plus, per slot, the automaton of the token sequences it may hold."""

    template: Template
    automata: tuple[SlotAutomaton, ...]


MAX_CACHED_TEMPLATES = 256  # compiled schemas kept per engine, the oldest dropped first
MAX_CACHED_AUTOMATA = 64  # slot automata (one per distinct value language and width)


class TemplateCompiler:
    """Compiles schemas for one tokenizer, caching token bytes, automata and templates."""

    def __init__(self, codec: TextCodec, mask_id: int) -> None:
        self.codec, self.mask_id = codec, mask_id
        special = set(codec.tokenizer.get_added_tokens_decoder()) | {codec.end_id, mask_id}
        self.token_bytes = token_byte_strings(codec.tokenizer, special)
        self.longest_token = max(len(b) for b in self.token_bytes if b)
        self._automata: dict[tuple[Node, int], SlotAutomaton] = {}
        self._templates: dict[str, ConstrainedTemplate] = {}

    def compile(self, schema: dict, max_tokens: int | None = None) -> ConstrainedTemplate:
        """Raises SchemaTemplateError when the schema cannot be laid out or enforced, or when its
        template is longer than `max_tokens` (checked before the slots' automata are built:
        a wide slot costs seconds to compile). A malformed keyword value is refused the same way."""
        key = json.dumps(schema, default=str)  # property order is the template's order: keep it
        found = self._templates.get(key)
        try:
            template = found.template if found is not None else build_template(schema, self.codec, self.mask_id)
            if max_tokens is not None and len(template.ids) > max_tokens:
                raise SchemaTemplateError(f"the template takes {len(template.ids)} tokens, more than max_tokens "
                                          f"({max_tokens}): lower maxLength or x-nowait-slot-tokens")
            if found is None:
                found = self._templates[key] = self._compile(schema, template)
                while len(self._templates) > MAX_CACHED_TEMPLATES:  # oldest first: dicts keep insertion order
                    self._templates.pop(next(iter(self._templates)))
        except SchemaTemplateError:
            raise
        except (TypeError, ValueError, UnicodeError) as error:  # e.g. x-nowait-slot-tokens: "abc", enum: []
            raise SchemaTemplateError(f"the schema cannot be laid out ({type(error).__name__}: {error})") from None
        return found

    def _compile(self, schema: dict, template: Template) -> ConstrainedTemplate:
        unknown = sorted(k for k in schema if k not in OBJECT_KEYWORDS | ANNOTATIONS and not k.startswith("x-"))
        if unknown:
            raise SchemaTemplateError(f"template infilling cannot enforce {', '.join(map(repr, unknown))}")
        properties = schema["properties"]
        missing = set(schema.get("required", [])) - set(properties)
        if missing:
            raise SchemaTemplateError(f"required properties without a schema: {sorted(missing)}")
        automata = []
        for slot in template.slots:
            language = value_language(slot.name, properties[slot.name], slot.width * self.longest_token)
            key = (language, slot.width)
            if key not in self._automata:
                try:
                    automaton = SlotAutomaton(compile_language(language), self.token_bytes, self.codec.end_id,
                                              slot.width)
                except PatternError as error:
                    raise SchemaTemplateError(f"property {slot.name!r}: {error}") from None
                self._automata[key] = automaton
                while len(self._automata) > MAX_CACHED_AUTOMATA:  # a wide slot's automaton holds megabytes
                    self._automata.pop(next(iter(self._automata)))
            automaton = self._automata[key]
            if not automaton.completable([None] * slot.width):
                raise SchemaTemplateError(f"property {slot.name!r}: no valid value fits its slot of "
                                          f"{slot.width} tokens (raise x-nowait-slot-tokens)")
            automata.append(automaton)
        return ConstrainedTemplate(template=template, automata=tuple(automata))


def compile_template(schema: dict, codec: TextCodec, mask_id: int) -> ConstrainedTemplate:
    """One-off `TemplateCompiler(codec, mask_id).compile(schema)` (engines keep a compiler)."""
    return TemplateCompiler(codec, mask_id).compile(schema)
