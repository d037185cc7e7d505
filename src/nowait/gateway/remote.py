"""A remote OpenAI-compatible upstream as an engine: an external API, or a vLLM/SGLang server.

The request sent upstream is rebuilt from the parsed Call (model replaced by the upstream's name,
only the fields the client set), never forwarded as received: the `nowait` metadata, the client's
API key and anything unknown stay in the gateway. Before any byte leaves, the upstream's allowed
data classes are checked once more here, whatever the dispatcher decided (defence in depth: a
restricted request must not reach an external API even through a bug upstream of this module).

Failures are sorted for the dispatcher: the client's own mistakes (4xx but 429) are answered as
they are; an unreachable, overloaded or failing upstream (connection error, timeout, 429, 5xx)
raises `UpstreamFailure`, which the dispatcher may turn into a re-run on the owned frontier engine.

The fast (diffusion) engine may be a remote one (`confidence=True`): its requests ask for the
chosen tokens' logprobs, and its Attempts carry the confidence they give (remote_confidence.py),
or none and why, which the dispatcher treats as too unsure to hand back.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from nowait.gateway.config import RemoteEngineConfig
from nowait.gateway.domain import Attempt, Call
from nowait.gateway.engine_stats import EngineStats
from nowait.gateway.errors import APIError, forbidden_destination, queue_full
from nowait.gateway.ledger import remote_cost_usd
from nowait.gateway.remote_confidence import TokenLogprobs, logprob_fields
from nowait.gateway.schemas import cached_tokens
from nowait.router import DataClass, RemoteEngine

log = logging.getLogger("nowait.gateway")


class UpstreamFailure(APIError):
    """The upstream could not answer (not the request's fault): a candidate for failover."""

    def __init__(self, engine: str, why: str) -> None:
        super().__init__(502, f"upstream {engine!r} failed: {why}", type="server_error", param="model",
                         code="upstream_error")


class RemoteBackend:
    kind = "remote"

    def __init__(self, name: str, config: RemoteEngineConfig, window_s: float,
                 transport: httpx.AsyncBaseTransport | None = None, confidence: bool = False) -> None:
        """`confidence`: this upstream serves as the fast engine, whose answers need a confidence."""
        self.name, self.config, self.confidence = name, config, confidence
        self._warned_no_logprobs = False
        self.owned = config.on_premises
        self.stats = EngineStats(window_s)  # priced per token: no node price
        self.allowed = None if config.on_premises else RemoteEngine(name=name, data_classes=tuple(config.data_classes))
        self.api_key = os.environ.get(config.api_key_env) if config.api_key_env else None
        self.available = not config.api_key_env or bool(self.api_key)
        self.unavailable_reason = "" if self.available else f"environment variable {config.api_key_env} is not set"
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.in_flight = 0

    @property
    def admits(self) -> int:
        return self.config.max_concurrency

    def may_receive(self, data_class: DataClass) -> bool:
        return self.allowed is None or self.allowed.may_receive(DataClass(data_class))

    def running(self) -> int:
        return self.in_flight

    def waiting(self) -> int:
        return 0

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(base_url=self.config.base_url, headers=headers, transport=self._transport,
                                         timeout=httpx.Timeout(self.config.timeout_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=self.config.max_concurrency))

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # --- the request sent upstream ---

    def upstream_body(self, call: Call, stream: bool) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.config.model}
        if call.endpoint == "chat":
            path = "/chat/completions"
            body["messages"] = call.messages
        else:
            path = "/completions"
            body["prompt"] = call.prompt
        s = call.sampling
        for key, value in (("max_tokens", s.max_tokens), ("temperature", s.temperature), ("top_p", s.top_p),
                           ("seed", s.seed)):
            if value is not None:
                body[key] = value
        if s.stop:
            body["stop"] = list(s.stop)
        if call.response_format is not None:
            body["response_format"] = call.response_format
        if self.confidence:
            for key, value in logprob_fields(call.endpoint).items():
                body.setdefault(key, value)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}  # the ledger needs the token counts
        return path, body

    def _check(self, call: Call) -> None:
        if not self.may_receive(call.meta.data_class):
            raise forbidden_destination(f"{DataClass(call.meta.data_class).value} data may not be sent to remote "
                                        f"engine {self.name!r}")
        if self._client is None:
            raise UpstreamFailure(self.name, "not started")
        if self.in_flight >= self.admits:
            raise queue_full(self.name, 1)

    def _attempt(self, text: str, finish_reason: str, usage: dict | None, started: float,
                 first_token_s: float | None, chunks: int = 0, logprobs: TokenLogprobs | None = None) -> Attempt:
        confidence, missing = logprobs.confidence() if self.confidence and logprobs else (None, "")
        if self.confidence and confidence is None and not self._warned_no_logprobs:
            self._warned_no_logprobs = True  # once: each such answer is counted (fallbacks, cause confidence_unknown)
            log.warning("fast engine %r: %s, so its answers have no confidence and re-run on the fallback engine",
                        self.name, missing)
        usage = usage or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = cached_tokens(usage)
        completion = int(usage.get("completion_tokens") or chunks)  # no usage: count the chunks
        cost = remote_cost_usd(prompt, completion, self.config.input_usd_per_mtok, self.config.output_usd_per_mtok)
        seconds = time.perf_counter() - started
        self.stats.record(busy_s=seconds, tokens=completion, spend_usd=cost)
        self.stats.record_request(seconds)
        return Attempt(engine=self.name, text=text, finish_reason=finish_reason or "stop", prompt_tokens=prompt,
                       cached_prompt_tokens=cached, completion_tokens=completion, confidence=confidence,
                       confidence_missing=missing, seconds=seconds, first_token_s=first_token_s, cost_usd=cost)

    @staticmethod
    def _client_error(response: httpx.Response) -> APIError:
        try:
            error = response.json()["error"]
            return APIError(response.status_code, str(error.get("message")), type=error.get("type") or
                            "invalid_request_error", param=error.get("param"), code=error.get("code"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return APIError(response.status_code, f"upstream answered {response.status_code}: {response.text[:200]}")

    def _raise_for(self, response: httpx.Response) -> None:
        if response.status_code == 429 or response.status_code >= 500:
            raise UpstreamFailure(self.name, f"HTTP {response.status_code}")
        if response.status_code >= 400:
            raise self._client_error(response)

    # --- the two ways to run ---

    async def run(self, call: Call, timeout_s: float) -> Attempt:
        self._check(call)
        path, body = self.upstream_body(call, stream=False)
        started = time.perf_counter()
        self.in_flight += 1
        try:
            response = await self._client.post(path, json=body, timeout=min(timeout_s, self.config.timeout_s))
            self._raise_for(response)
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if call.endpoint == "chat" else choice["text"]
            logprobs = TokenLogprobs()
            logprobs.add(choice.get("logprobs"))
        except httpx.HTTPError as error:
            raise UpstreamFailure(self.name, f"{type(error).__name__}: {error}") from None
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise UpstreamFailure(self.name, f"unreadable answer ({error!r})") from None
        finally:
            self.in_flight -= 1
        return self._attempt(text or "", choice.get("finish_reason") or "stop", data.get("usage"), started, None,
                             logprobs=logprobs)

    async def open_stream(self, call: Call, timeout_s: float) -> RemoteStream:
        """Returns once the upstream answered 200, so a refusal or an outage is still an HTTP error."""
        self._check(call)
        path, body = self.upstream_body(call, stream=True)
        started = time.perf_counter()
        request = self._client.build_request("POST", path, json=body, timeout=min(timeout_s, self.config.timeout_s))
        self.in_flight += 1
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as error:
            self.in_flight -= 1
            raise UpstreamFailure(self.name, f"{type(error).__name__}: {error}") from None
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            self.in_flight -= 1
            self._raise_for(response)
            raise UpstreamFailure(self.name, f"HTTP {response.status_code}")
        return RemoteStream(self, call, response, started)


class RemoteStream:
    def __init__(self, backend: RemoteBackend, call: Call, response: httpx.Response, started: float) -> None:
        self.backend, self.call, self.response, self.started = backend, call, response, started
        self.attempt: Attempt | None = None
        self._closed = False

    async def deltas(self) -> AsyncIterator[str]:
        parts: list[str] = []
        finish, usage, first, chunks = "stop", None, None, 0
        logprobs = TokenLogprobs()
        try:
            async for line in self.response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise UpstreamFailure(self.backend.name, str(event["error"]))
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if self.call.endpoint == "chat" \
                        else choice.get("text")
                    logprobs.add(choice.get("logprobs"), has_text=bool(piece))
                    if piece:
                        first = first if first is not None else time.perf_counter() - self.started
                        chunks += 1
                        parts.append(piece)
                        yield piece
                    finish = choice.get("finish_reason") or finish
            self.attempt = self.backend._attempt("".join(parts), finish, usage, self.started, first, chunks, logprobs)
        except httpx.HTTPError as error:
            raise UpstreamFailure(self.backend.name, f"{type(error).__name__}: {error}") from None
        except (ValueError, AttributeError, TypeError) as error:  # not JSON, or JSON of another shape
            raise UpstreamFailure(self.backend.name, f"unreadable stream ({type(error).__name__}: {error})") from None
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.in_flight -= 1
            await self.response.aclose()
