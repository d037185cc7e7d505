"""Schema templates for diffusion infilling: layout, slot widths, fill/read round trip."""

from __future__ import annotations

import json

import pytest

from nowait import paths
from nowait.engines.structured.templates import (
    DATE_SLOT_WIDTH,
    SchemaTemplateError,
    build_template,
    fill_template,
    read_template,
    slot_width,
)
from nowait.extraction.corpus import KINDS, documents, schema_for
from nowait.tokenizer import TextCodec


@pytest.fixture(scope="module")
def bundled_codec() -> TextCodec:
    return TextCodec.from_file(paths.tokenizer_path())


def test_template_keeps_structure_fixed_and_masks_only_slots(codec):
    template = build_template(schema_for("kyc"), codec, codec.mask_id)
    assert [slot.name for slot in template.slots] == list(schema_for("kyc")["properties"])
    masked = [i for i, token in enumerate(template.ids) if token == codec.mask_id]
    assert masked == template.slot_positions
    fixed_text = codec.decode([t for t in template.ids if t != codec.mask_id])
    assert fixed_text.startswith('{"full_name": ') and fixed_text.endswith("}")
    assert '"occupation": ' in fixed_text


@pytest.mark.parametrize("kind", KINDS)
def test_fill_then_read_gives_the_truth_for_every_document(bundled_codec, kind):
    codec = bundled_codec
    template = build_template(schema_for(kind), codec, codec.mask_id)
    for doc in [d for d in documents("validation", 300) if d.kind == kind]:
        ids = fill_template(template, doc.fields, codec)
        assert ids is not None, doc.fields  # under the bundled tokenizer the widths fit every value
        assert len(ids) == len(template.ids)
        assert json.loads(read_template(template, ids, codec)) == doc.fields


def test_value_too_long_for_its_slot_is_rejected(codec):
    schema = {"type": "object", "properties": {"name": {"type": "string", "x-nowait-slot-tokens": 3}}}
    template = build_template(schema, codec, codec.mask_id)
    assert fill_template(template, {"name": "a much longer value than three tokens"}, codec) is None
    assert fill_template(template, {"name": "a"}, codec) is not None


def test_slot_widths_follow_the_schema(codec):
    assert slot_width({"type": "string", "format": "date"}, codec) == DATE_SLOT_WIDTH
    assert slot_width({"type": "string", "maxLength": 5}, codec) == 7
    assert slot_width({"type": "integer"}, codec) < slot_width({"type": "string"}, codec)
    enum_width = slot_width({"enum": ["a", "self_employed"]}, codec)
    assert enum_width == len(codec.encode('"self_employed"'))


def test_caller_schema_with_other_names(codec):
    schema = {"type": "object", "properties": {"customer": {"type": "string"}, "born": {"type": "string",
              "format": "date"}}}
    template = build_template(schema, codec, codec.mask_id)
    ids = fill_template(template, {"customer": "Ada Okafor", "born": "1985-03-12"}, codec)
    assert json.loads(read_template(template, ids, codec)) == {"customer": "Ada Okafor", "born": "1985-03-12"}


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string"}},
    {"type": "object", "properties": {}},
    {"type": "object", "properties": {"nested": {"type": "object"}}},
    {"type": "object"},
])
def test_unsupported_schemas_are_rejected(codec, schema):
    with pytest.raises(SchemaTemplateError):
        build_template(schema, codec, codec.mask_id)
