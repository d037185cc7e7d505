"""The HTTP side of the load bench: any OpenAI-compatible server, over httpx.

- `probe`: `GET /v1/models` once before a run, so an unreachable server is one clear error
  rather than a run of failed requests; the nowait gateway's model cards also say each model's
  engine kind (ar, spec, diffusion, remote, router), which the planner profile needs.
- `stream_chat` / `complete_chat`: one chat completion, timed on the client. Streaming is the
  default (TTFT and inter-token latency need it); the usage chunk gives the server's token count.
  The nowait gateway's `x-nowait-route` header and `nowait` object, when present, say which engine
  answered, by which rule, with what fallback, forwards and cost; other servers simply lack them.
- `BatchClient`: the Batch API (`/v1/files`, `/v1/batches`): upload, create, poll, download.

Times are `time.perf_counter()` seconds minus the run's start, so records of one run compare.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from nowait.bench.load_metrics import EngineRun, RequestRecord
from nowait.bench.load_workload import LoadRequest
from nowait.gateway.schemas import cached_tokens

ROUTE_HEADER = "x-nowait-route"
TERMINAL_BATCH_STATUSES = ("completed", "failed", "cancelled", "expired")


class TargetError(ValueError):
    """A target the bench cannot use (unreachable, refuses the key, unknown model): one line."""


def normalize_base_url(url: str) -> str:
    """'http://host:8000' or 'http://host:8000/v1/' -> 'http://host:8000/v1'."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise TargetError(f"--base-url must start with http:// or https:// (got {url!r})")
    return url if url.endswith("/v1") else url + "/v1"


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _reason(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def error_message(response: httpx.Response) -> str:
    """The OpenAI error object's message, else the start of the body."""
    try:
        body = response.json()
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    except ValueError:
        message = None
    return message or response.text[:200] or response.reason_phrase


@dataclass
class ServerInfo:
    base_url: str
    models: dict[str, str | None] = field(default_factory=dict)  # id -> engine kind (nowait) or None

    def kind_of(self, engine: str | None) -> str | None:
        return self.models.get(engine) if engine else None


async def probe(client: httpx.AsyncClient, base_url: str) -> ServerInfo:
    """The server's model list; raises TargetError when it cannot be reached or refuses the key."""
    try:
        response = await client.get(f"{base_url}/models", timeout=10.0)
    except httpx.TransportError as error:
        raise TargetError(f"cannot reach {base_url} ({_reason(error)})") from None
    if response.status_code in (401, 403):
        raise TargetError(f"{base_url} refused the request (HTTP {response.status_code}: {error_message(response)}); "
                          "give --api-key")
    info = ServerInfo(base_url)
    if response.status_code == 200:
        try:
            for card in response.json().get("data", []):
                info.models[card["id"]] = card.get("kind")
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # not every server lists models; --model then names one
    return info


def _engine_runs(info: dict | None) -> tuple[EngineRun, ...]:
    runs = []
    for tried in (info or {}).get("engines_tried") or []:
        runs.append(EngineRun(engine=str(tried.get("engine")), seconds=float(tried.get("seconds") or 0.0),
                              prompt_tokens=int(tried.get("prompt_tokens") or 0),
                              completion_tokens=int(tried.get("completion_tokens") or 0),
                              forwards=tried.get("forwards"), outcome=str(tried.get("outcome") or "")))
    return tuple(runs)


def _apply_nowait(record: RequestRecord, info: dict | None, route: str | None) -> None:
    """Copy the gateway's explanation onto the record (absent on other servers)."""
    record.engine = route or (info or {}).get("route") or record.engine
    if info:
        record.rule = info.get("rule")
        record.fallback = bool(info.get("fallback"))
        record.low_confidence = bool(info.get("low_confidence"))
        record.cost_usd = info.get("cost_usd")
        record.attempts = _engine_runs(info)


def record_from_body(request: LoadRequest, target: str, sent_s: float, done_s: float, status: int,
                     body: dict | None, route: str | None = None, error: str | None = None,
                     label: str = "") -> RequestRecord:
    """A record from a non-streamed chat completion (also a Batch API output line)."""
    record = RequestRecord(target=target, sent_s=sent_s, done_s=done_s, status=status, error=error,
                           latency_target_s=request.latency_target_s, label=label)
    if status != 200 or body is None:
        record.error = error or "no answer"
        return record
    try:
        text = body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        record.error = "the answer has no choices[0].message.content"
        return record
    usage = body.get("usage") or {}
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.cached_prompt_tokens = cached_tokens(usage)
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    record.first_token_s = done_s  # not streamed: the first token arrives with the last
    _apply_nowait(record, body.get("nowait"), route)
    record.score = request.score(text)
    return record


async def complete_chat(client: httpx.AsyncClient, base_url: str, request: LoadRequest, model: str, t0: float,
                        timeout_s: float, label: str = "") -> RequestRecord:
    """One non-streamed chat completion."""
    sent = time.perf_counter() - t0
    try:
        response = await client.post(f"{base_url}/chat/completions", json=request.body(model, stream=False),
                                     headers=request.metadata.headers(), timeout=timeout_s)
    except httpx.HTTPError as error:
        return RequestRecord(target=model, sent_s=sent, done_s=time.perf_counter() - t0, status=0,
                             error=_reason(error), latency_target_s=request.latency_target_s, label=label)
    done = time.perf_counter() - t0
    if response.status_code != 200:
        return record_from_body(request, model, sent, done, response.status_code, None,
                                error=error_message(response), label=label)
    try:
        body = response.json()
    except ValueError:
        return record_from_body(request, model, sent, done, 200, None, error="the answer is not JSON", label=label)
    return record_from_body(request, model, sent, done, 200, body, response.headers.get(ROUTE_HEADER), label=label)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict | None]:
    """The JSON events of an OpenAI-style server-sent-event stream, then None for `data: [DONE]`;
    read on to the body's end after it (what the OpenAI SDK does): a response left unread is
    closed with its connection, so the next request would pay a new connection's set-up."""
    done = False
    async for line in response.aiter_lines():
        if done or not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            yield None
            continue
        yield json.loads(data)


async def stream_chat(client: httpx.AsyncClient, base_url: str, request: LoadRequest, model: str, t0: float,
                      timeout_s: float, label: str = "") -> RequestRecord:
    """One streamed chat completion, read to `[DONE]`: TTFT at the first content delta."""
    record = RequestRecord(target=model, sent_s=time.perf_counter() - t0, done_s=0.0,
                           latency_target_s=request.latency_target_s, label=label)
    pieces: list[str] = []
    chunks, info, usage, done, done_s = 0, None, None, False, None
    try:
        async with client.stream("POST", f"{base_url}/chat/completions", json=request.body(model, stream=True),
                                 headers=request.metadata.headers(), timeout=timeout_s) as response:
            if response.status_code != 200:
                await response.aread()
                record.status, record.error = response.status_code, error_message(response)
                record.done_s = time.perf_counter() - t0
                return record
            route = response.headers.get(ROUTE_HEADER)
            async for event in sse_events(response):
                if event is None:  # the answer is complete; the loop only drains the body now
                    done, done_s = True, time.perf_counter() - t0
                    continue
                if "error" in event:  # an error after the first byte arrives as an event
                    record.error = str((event["error"] or {}).get("message") or event["error"])
                    break
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if record.first_token_s is None:
                            record.first_token_s = time.perf_counter() - t0
                        pieces.append(content)
                        chunks += 1
                info = event.get("nowait") or info
                usage = event.get("usage") or usage
    except (httpx.HTTPError, ValueError) as error:
        record.status, record.error = (record.status if isinstance(error, ValueError) else 0), _reason(error)
    record.done_s = time.perf_counter() - t0 if done_s is None else done_s
    if record.error is None and not done:
        record.error = "the stream ended without [DONE]"
    if record.error is not None:
        return record
    record.prompt_tokens = int((usage or {}).get("prompt_tokens") or 0)
    record.cached_prompt_tokens = cached_tokens(usage)
    # Servers that send no usage chunk: one token per content chunk is the best guess left.
    record.output_tokens = int((usage or {}).get("completion_tokens") or chunks)
    _apply_nowait(record, info, route)
    record.score = request.score("".join(pieces))
    return record


class BatchRefused(TargetError):
    """The Batch API answered with an error status (kept, for callers that count them)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


CANCEL_GRACE_S = 30.0  # after cancelling a batch, how long its running lines are waited for


class BatchClient:
    """The OpenAI Batch API over httpx: one JSONL file in, one batch, its output and error files out."""

    def __init__(self, client: httpx.AsyncClient, base_url: str) -> None:
        self.client, self.base_url = client, base_url

    async def _check(self, response: httpx.Response, what: str) -> dict:
        if response.status_code != 200:
            raise BatchRefused(f"{what} failed (HTTP {response.status_code}: {error_message(response)})",
                               response.status_code)
        return response.json()

    async def submit(self, lines: list[dict], metadata: dict[str, str] | None = None) -> dict:
        """Upload the lines as a `purpose: batch` file and create the batch; returns the batch object."""
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        try:
            uploaded = await self._check(await self.client.post(
                f"{self.base_url}/files", files={"file": ("batch.jsonl", content, "application/jsonl")},
                data={"purpose": "batch"}, timeout=60.0), "uploading the batch file")
            body = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            if metadata:
                body["metadata"] = metadata
            return await self._check(await self.client.post(f"{self.base_url}/batches", json=body, timeout=60.0),
                                     "creating the batch")
        except httpx.HTTPError as error:
            raise TargetError(f"the Batch API at {self.base_url} failed ({_reason(error)})") from None

    async def retrieve(self, batch_id: str) -> dict:
        return await self._check(await self.client.get(f"{self.base_url}/batches/{batch_id}", timeout=30.0),
                                 "polling the batch")

    async def cancel(self, batch_id: str) -> None:
        await self.client.post(f"{self.base_url}/batches/{batch_id}/cancel", timeout=30.0)

    async def wait(self, batch_id: str, deadline: float, poll_s: float = 0.5, stop: asyncio.Event | None = None,
                   on_poll: Callable[[dict], None] | None = None) -> dict:
        """Poll until the batch ends, `deadline` (perf_counter) passes or `stop` is set; a batch
        still running then is cancelled (its answered lines are kept) and polled to its end, for
        at most CANCEL_GRACE_S more: a cancel waits for the lines already running, and the
        caller's time is bounded whatever the server does (the batch is returned as it stands)."""
        batch = await self.retrieve(batch_id)
        cancelled_at: float | None = None
        while batch["status"] not in TERMINAL_BATCH_STATUSES:
            if on_poll is not None:
                on_poll(batch)
            now = time.perf_counter()
            if cancelled_at is None and (now > deadline or (stop is not None and stop.is_set())):
                await self.cancel(batch_id)
                cancelled_at = now
            elif cancelled_at is not None and now - cancelled_at > CANCEL_GRACE_S:
                break
            await asyncio.sleep(poll_s)
            batch = await self.retrieve(batch_id)
        if on_poll is not None:
            on_poll(batch)
        return batch

    async def entries(self, batch: dict) -> list[dict]:
        """Every line of the batch's output and error files, as written (a line answered twice
        shows twice)."""
        out: list[dict] = []
        for key in ("output_file_id", "error_file_id"):
            file_id = batch.get(key)
            if not file_id:
                continue
            response = await self.client.get(f"{self.base_url}/files/{file_id}/content", timeout=60.0)
            if response.status_code != 200:
                raise TargetError(f"downloading {file_id} failed (HTTP {response.status_code})")
            out.extend(json.loads(line) for line in response.text.splitlines() if line.strip())
        return out

    async def results(self, batch: dict) -> dict[str, tuple[int, dict | None, str | None]]:
        """custom_id -> (status code, response body, error message) over the output and error files."""
        out: dict[str, tuple[int, dict | None, str | None]] = {}
        for entry in await self.entries(batch):
            answer = entry.get("response") or {}
            body = answer.get("body")
            status = int(answer.get("status_code") or 0)
            error = (entry.get("error") or {}).get("message") or (
                (body or {}).get("error", {}).get("message") if status != 200 else None)
            out[entry["custom_id"]] = (status, body if status == 200 else None, error)
        return out
