"""JSON Schema -> an answer template for diffusion infilling.

The template holds the object's braces, keys, colons and commas as fixed tokens and one slot of
bounded width per property. A slot holds the property's JSON value (quotes included, or
`null`) followed by end tokens up to its width. A diffusion model unmasks only the slots, so the
structure is right by construction and each value is written in parallel with the others.
The demo diffusion model is trained on this layout (and on free-form JSON), so it has learned
to pad a slot with end tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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

    An explicit `x-nowait-slot-tokens` wins; an enum takes its longest option; a date takes a
    quoted ISO date; `maxLength` bounds a string; otherwise a default per JSON type.
    """
    if "x-nowait-slot-tokens" in schema:
        return int(schema["x-nowait-slot-tokens"])
    if "enum" in schema:
        return max(len(codec.encode(json.dumps(option, ensure_ascii=False))) for option in schema["enum"])
    if schema.get("format") == "date":
        return DATE_SLOT_WIDTH
    types = [t for t in _types(schema) if t != "null"] or ["null"]
    if types == ["string"] and "maxLength" in schema:
        return int(schema["maxLength"]) + 2
    return max(SLOT_WIDTH_BY_TYPE.get(t, SLOT_WIDTH_BY_TYPE["string"]) for t in types)


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
