"""OpenAI's Responses API on top of the chat path: a Responses body becomes the chat request it
means (instructions -> a system message, input -> messages, max_output_tokens -> max_tokens,
text.format -> response_format), so routing, pricing, validation and accounting are the chat
call's; and the chat Outcome becomes a Response object, or the typed events of a streamed one.

What nowait cannot honour is refused with a 400 naming the field: `previous_response_id` and
`conversation` (nothing is stored: `store` is accepted and the answer says `store: false`),
`background`, tools, reasoning, `include`, logprobs, and input items other than text messages.
A Responses error names the Responses fields (`input`, `max_output_tokens`, `text.format`), not
the chat fields it was checked as.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import Field, ValidationError

from nowait.gateway.dispatch import Outcome
from nowait.gateway.errors import APIError, bad_request
from nowait.gateway.responses import nowait_info, usage
from nowait.gateway.schemas import ChatCompletionRequest, NowaitRequestOptions, OpenAIRequest

# Chat names -> Responses names, for errors the chat path raises about a Responses request.
RESPONSES_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
                   ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
                   ("max_tokens", "max_output_tokens"), ("messages", "input"))
INPUT_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesTextFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(OpenAIRequest):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(OpenAIRequest):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # as on chat: vLLM's extension
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    text: ResponsesText | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    nowait: NowaitRequestOptions | None = None


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def renamed(error: APIError) -> APIError:
    """The same error, speaking of the Responses fields."""
    for chat, responses in RESPONSES_NAMES:
        error.message = error.message.replace(chat, responses)
        if error.param is not None and error.param.startswith(chat):
            error.param = responses + error.param[len(chat):]
    return error


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: nowait stores no responses; send the earlier "
                          "turns in input instead", param="previous_response_id", code="unsupported_parameter")
    refused = {"conversation": body.conversation is not None, "background": bool(body.background),
               "tools": bool(body.tools) or body.tool_choice not in (None, "none", "auto"),
               "reasoning": bool(body.reasoning), "include": bool(body.include),
               "top_logprobs": bool(body.top_logprobs)}
    for name, given in refused.items():
        if given:
            raise bad_request(f"{name} is not supported by nowait's Responses API", param=name,
                              code="unsupported_parameter")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in INPUT_TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{index}]: only text parts are supported, got {kind!r}",
                              param=f"{where}.content[{index}]", code="unsupported_content")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(body: ResponsesRequest) -> list[dict[str, str]]:
    """instructions (a system message) then input, as chat messages."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    if not body.input:
        raise bad_request("input is empty", param="input")
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (only messages)",
                              param=where, code="unsupported_parameter")
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_request(f"{where}.role must be system, developer, user or assistant, got {role!r}",
                              param=f"{where}.role")
        messages.append({"role": role, "content": _content_text(item.get("content"), where)})
    return messages


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses body means (validated as one, so the same limits hold)."""
    _refuse_unsupported(body)
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        response_format = {"type": fmt.type}
    fields = {"model": body.model, "messages": input_messages(body), "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
              "response_format": response_format, "user": body.user,
              "nowait": body.nowait.model_dump(exclude_none=True) if body.nowait is not None else None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{param}: {first['msg']}", param=param, code="invalid_value") from None


# --- answers ---


def text_format(body: ResponsesRequest) -> dict:
    fmt = body.text.format if body.text is not None else None
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def response_usage(outcome: Outcome) -> dict:
    counted = usage([outcome])
    cached = counted.prompt_tokens_details.cached_tokens if counted.prompt_tokens_details else 0
    return {"input_tokens": counted.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": counted.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counted.total_tokens}


def cut_short(outcome: Outcome) -> bool:
    """An answer stopped by max_output_tokens is `incomplete`, as OpenAI marks it."""
    return outcome.final.finish_reason == "length"


class ResponseBuilder:
    """The Response object of one request, at each stage: in progress, then answered."""

    def __init__(self, body: ResponsesRequest, response_id: str, message_id: str) -> None:
        self.body, self.response_id, self.message_id = body, response_id, message_id
        self.created_at = int(time.time())

    def base(self, status: str) -> dict:
        body = self.body
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": body.model, "output": [],
                "parallel_tool_calls": False, "previous_response_id": None, "store": False,
                "temperature": body.temperature, "top_p": body.top_p, "text": text_format(body),
                "tool_choice": "none", "tools": [], "truncation": "disabled", "usage": None,
                "metadata": body.metadata or {}, "user": body.user}

    def answered(self, outcome: Outcome) -> dict:
        incomplete = cut_short(outcome)
        status = "incomplete" if incomplete else "completed"
        return self.base(status) | {
            "completed_at": int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": [message_item(self.message_id, outcome.final.text, status)],
            "usage": response_usage(outcome), "nowait": nowait_info([outcome]).model_dump()}

    def failed(self, error: APIError) -> dict:
        return self.base("failed") | {"error": {"code": error.code or "server_error", "message": error.message}}


class ResponseEvents:
    """The typed server-sent events of one streamed Response, numbered in order."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder, self.sequence = builder, 0
        self.text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.builder.message_id, "output_index": 0}

    def opening(self) -> list[str]:
        progress = self.builder.base("in_progress")
        return [self._event("response.created", response=progress),
                self._event("response.in_progress", response=progress),
                self._event("response.output_item.added", output_index=0,
                            item=message_item(self.builder.message_id, None, "in_progress")),
                self._event("response.content_part.added", **self._where(), content_index=0,
                            part=output_text_part(""))]

    def delta(self, text: str) -> str:
        self.text.append(text)
        return self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])

    def closing(self, outcome: Outcome) -> list[str]:
        response = self.builder.answered(outcome)
        item = response["output"][0]
        # The text sent is the answer; the Response object says the same.
        text = "".join(self.text)
        item["content"][0]["text"] = text
        return [self._event("response.output_text.done", **self._where(), content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), content_index=0,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                            response=response)]

    def failure(self, error: APIError) -> list[str]:
        error = renamed(error)
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=self.builder.failed(error))]

    def end(self) -> list[str]:
        return []  # the Responses API's streams end with their last typed event, no [DONE]
