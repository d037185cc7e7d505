"""OpenAI request bodies -> `Call`s: the request metadata, the prompt, the schema, the sampling.

Metadata comes from the body's `"nowait"` object, else the `x-nowait-*` headers, else the config's
defaults (the body wins when both are given: it is the more specific of the two). Features nowait
cannot honour are refused here with a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from nowait.engines.base import MAX_TOP_LOGPROBS
from nowait.gateway.config import RequestDefaults
from nowait.gateway.domain import Call, Metadata, Sampling
from nowait.gateway.errors import bad_request
from nowait.gateway.prompts import plain_messages, response_schema
from nowait.gateway.schemas import ChatCompletionRequest, CompletionRequest, NowaitRequestOptions, SamplingRequest
from nowait.router import DataClass

HEADERS = {
    "latency_budget_ms": "x-nowait-latency-budget-ms",
    "token_value_usd_per_mtok": "x-nowait-token-value",
    "data_class": "x-nowait-data-class",
    "batchable": "x-nowait-batchable",
}
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _header_value(name: str, header: str, raw: str) -> float | bool | DataClass:
    value = raw.strip()
    if name == "batchable":
        if value.lower() in TRUE | FALSE:
            return value.lower() in TRUE
        raise bad_request(f"{header} must be true or false, got {raw!r}", param=header)
    if name == "data_class":
        try:
            return DataClass(value.lower())
        except ValueError:
            raise bad_request(f"{header} must be one of {', '.join(c.value for c in DataClass)}, got {raw!r}",
                              param=header) from None
    try:
        number = float(value)
    except ValueError:
        raise bad_request(f"{header} must be a number, got {raw!r}", param=header) from None
    if number < 0 or (name == "latency_budget_ms" and number == 0) or number != number:
        raise bad_request(f"{header} must be {'> 0' if name == 'latency_budget_ms' else '>= 0'}, got {raw!r}",
                          param=header)
    return number


def metadata(options: NowaitRequestOptions | None, headers: Mapping[str, str], defaults: RequestDefaults,
             batch: bool = False, batch_data_class: DataClass | None = None) -> Metadata:
    """The routing metadata of one request. Batch lines default to batchable (they are offline)."""
    given = {name: _header_value(name, header, headers[header]) for name, header in HEADERS.items()
             if header in headers}
    stamped = given.get("data_class")
    if options is not None:
        given.update(options.model_dump(exclude_none=True))
    if stamped is not None and "data_class" in given:
        # A header (a proxy may stamp it) and the body may disagree: the stricter class holds,
        # so a body can never loosen what the header says.
        given["data_class"] = max(DataClass(stamped), DataClass(given["data_class"]), key=list(DataClass).index)
    return Metadata(
        latency_budget_ms=given.get("latency_budget_ms", defaults.latency_budget_ms),
        token_value_usd_per_mtok=given.get("token_value_usd_per_mtok", defaults.token_value_usd_per_mtok),
        data_class=DataClass(given.get("data_class", batch_data_class or defaults.data_class)),
        batchable=given.get("batchable", True if batch else defaults.batchable),
    )


def _top_count(value: object, param: str) -> int:
    """A top-logprobs count as OpenAI checks it: an integer in [0, 20], else a 400 with its code."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"Invalid type for '{param}': expected an integer, but got {value!r} instead.",
                          param=param, code="invalid_type")
    if value < 0:
        raise bad_request(f"Invalid '{param}': integer below minimum value. Expected a value >= 0, but got "
                          f"{value} instead.", param=param, code="integer_below_min_value")
    if value > MAX_TOP_LOGPROBS:
        raise bad_request(f"Invalid '{param}': integer above maximum value. Expected a value <= "
                          f"{MAX_TOP_LOGPROBS}, but got {value} instead.", param=param, code="integer_above_max_value")
    return value


def chat_logprob_count(body: ChatCompletionRequest) -> int | None:
    """Chat: `logprobs: true` asks, `top_logprobs` (0-20) adds alternatives, and needs it (as OpenAI)."""
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
        raise bad_request(f"Invalid type for 'logprobs': expected a boolean, but got {body.logprobs!r} instead.",
                          param="logprobs", code="invalid_type")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("Invalid value for 'top_logprobs': logprobs must be set to true when top_logprobs is "
                          "given.", param="top_logprobs", code="invalid_value")
    if not body.logprobs:
        return None
    return 0 if body.top_logprobs is None else _top_count(body.top_logprobs, "top_logprobs")


def completion_logprob_count(body: CompletionRequest) -> int | None:
    """Legacy completions: `logprobs` is itself the count of alternatives (OpenAI caps it at 5,
    nowait, like vLLM, at 20)."""
    return None if body.logprobs is None else _top_count(body.logprobs, "logprobs")


def _refuse_unsupported(body: SamplingRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise bad_request(f"{name} is not supported by nowait", param=name, code="unsupported_parameter")
    if body.n > 1 and body.stream:
        raise bad_request("n > 1 is not supported with stream: true", param="n", code="unsupported_parameter")


def _sampling(body: SamplingRequest, max_tokens: int | None, index: int) -> Sampling:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    # n > 1 with a seed: a different seed per choice, or every sampled choice would be the same.
    seed = body.seed + index if body.seed is not None else None
    return Sampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    seed=seed, stop=tuple(s for s in stop if s))


def chat_calls(body: ChatCompletionRequest, headers: Mapping[str, str], defaults: RequestDefaults,
               request_id: str, batch: bool = False, batch_data_class: DataClass | None = None) -> list[Call]:
    """One Call per requested choice (`n`)."""
    _refuse_unsupported(body)
    if body.tools or body.tool_choice not in (None, "none"):
        raise bad_request("tools and tool_choice are not supported by nowait", param="tools",
                          code="unsupported_parameter")
    logprobs = chat_logprob_count(body)
    messages = plain_messages(body.messages)
    schema, json_mode = response_schema(body.response_format)
    meta = metadata(body.nowait, headers, defaults, batch, batch_data_class)
    max_tokens = body.max_completion_tokens or body.max_tokens
    response_format = body.response_format.model_dump(by_alias=True, exclude_none=True) if body.response_format \
        else None
    return [Call(request_id=f"{request_id}-{i}" if body.n > 1 else request_id, endpoint="chat", model=body.model,
                 meta=meta, sampling=_sampling(body, max_tokens, i), messages=messages, schema=schema,
                 json_mode=json_mode, response_format=response_format, logprobs=logprobs) for i in range(body.n)]


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def completion_calls(body: CompletionRequest, headers: Mapping[str, str], defaults: RequestDefaults,
                     request_id: str, batch: bool = False,
                     batch_data_class: DataClass | None = None) -> list[Call]:
    """One Call per prompt and choice, prompt-major (choice index = prompt index x n + choice)."""
    _refuse_unsupported(body)
    if body.echo or body.suffix or (body.best_of or 1) > 1:
        raise bad_request("echo, suffix and best_of are not supported by nowait", param="echo",
                          code="unsupported_parameter")
    logprobs = completion_logprob_count(body)
    prompts = prompts_of(body)
    if body.stream and len(prompts) > 1:
        raise bad_request("several prompts are not supported with stream: true", param="prompt",
                          code="unsupported_parameter")
    schema, json_mode = response_schema(body.response_format)
    meta = metadata(body.nowait, headers, defaults, batch, batch_data_class)
    response_format = body.response_format.model_dump(by_alias=True, exclude_none=True) if body.response_format \
        else None
    calls = []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            index = p * body.n + i
            calls.append(Call(request_id=f"{request_id}-{index}" if len(prompts) * body.n > 1 else request_id,
                              endpoint="completions", model=body.model, meta=meta,
                              sampling=_sampling(body, body.max_tokens, i), prompt=prompt, schema=schema,
                              json_mode=json_mode, response_format=response_format, logprobs=logprobs))
    return calls
