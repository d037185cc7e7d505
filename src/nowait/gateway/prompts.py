"""From what an OpenAI client sends to what an owned model reads: the prompt text and the schema.

Chat messages map onto the models' prompt template (`nowait.tokenizer.render_chat`). The demo
models are trained on one shape, `<|user|>INSTRUCTION\\nDOCUMENT\\n<|assistant|>`, so the usual
way a client asks for an extraction (a system message with the instruction, a user message with
the pasted document; or one user message holding both) is folded into that single user turn.
A conversation with earlier assistant turns is rendered turn by turn instead.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from nowait.gateway.errors import bad_request
from nowait.gateway.schemas import ChatMessage, ResponseFormat
from nowait.tokenizer import render_chat

# OpenAI's `json_object` mode: any JSON object. The AR grammar and the diffusion output check use it.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def message_text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                              param=f"messages[{index}].content", code="unsupported_content")
        texts.append(part.text)
    return "".join(texts)


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as role/content strings (`developer` is OpenAI's newer name for `system`)."""
    out = []
    for index, message in enumerate(messages):
        if message.role == "tool":
            raise bad_request(f"messages[{index}]: tool messages are not supported", param=f"messages[{index}].role",
                              code="unsupported_role")
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": message_text(message, index)})
    return out


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The prompt text for an owned model (see the module docstring)."""
    if any(m["role"] == "assistant" for m in messages[:-1]) or messages[-1]["role"] == "assistant":
        return render_chat(messages)
    parts = [m["content"].strip("\n") for m in messages if m["content"].strip()]
    return render_chat([{"role": "user", "content": "\n".join(parts) + "\n"}])


def response_schema(response_format: ResponseFormat | None) -> tuple[dict | None, bool]:
    """(schema, json_mode) for a response_format; raises a 400 naming the bad part."""
    if response_format is None or response_format.type == "text":
        return None, False
    if response_format.type == "json_object":
        return ANY_OBJECT, True
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format.json_schema.schema is required for type json_schema",
                          param="response_format.json_schema.schema", code="invalid_json_schema")
    check_schema(spec.schema_)
    return spec.schema_, True


@functools.lru_cache(maxsize=1024)
def _valid_json_schema(canonical: str) -> bool:
    """Checks the schema (canonical JSON) against the metaschema, raising SchemaError: clients
    send the same few schemas again and again, and the check took 1.7 ms of a 28 ms request. A
    refused schema raises, so it is not cached and is checked again when it comes back."""
    Draft202012Validator.check_schema(json.loads(canonical))
    return True


def check_schema(schema: dict) -> None:
    """Refuse a schema that is not a valid JSON Schema before any engine sees it."""
    try:
        _valid_json_schema(json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
    except SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        raise bad_request(f"response_format.json_schema.schema is not a valid JSON Schema"
                          f"{' at ' + where if where else ''}: {error.message}",
                          param="response_format.json_schema.schema", code="invalid_json_schema") from None
    if schema.get("type", "object") != "object":
        raise bad_request("response_format.json_schema.schema must describe an object (type: object)",
                          param="response_format.json_schema.schema", code="invalid_json_schema")


def conforms(text: str, schema: dict | None) -> bool:
    """Whether `text` is one JSON value valid for `schema` (used to judge a diffusion answer).
    NaN and Infinity are refused: Python reads them, a client's strict JSON parser does not."""
    def not_json(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    try:
        value = json.loads(text, parse_constant=not_json)
    except ValueError:
        return False
    if schema is None:
        return True
    return Draft202012Validator(schema).is_valid(value)
