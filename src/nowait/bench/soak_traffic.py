"""The mixed traffic of `nowait bench soak`: what a gateway meets in a day, over and over.

Each worker loops over the request kinds in an order drawn from its own seeded generator:

- `chat`: a chat completion, read whole;
- `stream_dropped`: a streamed chat completion the client drops after its first content chunk
  (the server must cancel its engine work and give its stream slot back);
- `responses_dropped`: the same on the Responses API's typed events;
- `json_schema`: a chat completion under `response_format: json_schema`;
- `malformed`: a body that is not JSON, a chat with no messages, a negative max_tokens, a batch
  of a file that does not exist (each must be a 4xx, never a 5xx);
- `unknown_model`: a chat completion naming a model nobody serves (404).

Beside them one loop creates batches one after another, cancels every other one right after
creating it, waits for each to end and keeps the custom_ids of its output and error files (see
`BatchLedger` for the lines a batch cancelled before validation took on), then
deletes its files (so a store that does not reuse freed space shows as growth). Every status is
counted per kind; a 5xx (or an error event of type server_error inside a stream) is a server
error, a connection that fails is a transport error.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from nowait.bench.load_http import BatchClient, BatchRefused, TargetError

KINDS = ("chat", "stream_dropped", "responses_dropped", "json_schema", "malformed", "unknown_model")
PROMPTS = ("Name: Ada Lovelace\nBorn: 1815\nSummarize:", "Invoice 4411, total 310 EUR, due 2026-03-01. Total:",
           "Loan request: 25,000 USD over 5 years. Kind:", "Contract between Acme and Initech. Parties:")
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["kyc", "loan"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}
UNKNOWN_MODEL = "no-such-model"
REQUEST_TIMEOUT_S = 300.0
BATCH_TIMEOUT_S = 600.0  # a batch not ended by then is cancelled; lines still unanswered count as lost


@dataclass
class Counts:
    statuses: Counter = field(default_factory=Counter)  # (kind, HTTP status) -> count; status 0: transport
    stream_server_errors: int = 0

    def record(self, kind: str, status: int) -> None:
        self.statuses[(kind, status)] += 1

    @property
    def server_errors(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status >= 500) + self.stream_server_errors

    @property
    def transport_errors(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if status == 0)

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (kind, status), n in sorted(self.statuses.items()):
            out.setdefault(kind, {})[str(status)] = n
        return out


@dataclass
class BatchLedger:
    """Per batch: the custom_ids sent and those its files answered. A batch cancelled before it
    was validated took on no lines (its request_counts.total is 0, as OpenAI's would be): its
    lines are not counted as accepted; every other created batch's lines are, all of them."""
    accepted: dict[str, list[str]] = field(default_factory=dict)
    answered: dict[str, list[str]] = field(default_factory=dict)
    cancelled: int = 0
    unvalidated: int = 0


def has_content(event: dict) -> bool:
    """A chat chunk with content, or a Responses text delta."""
    if event.get("type") == "response.output_text.delta":
        return True
    return any((choice.get("delta") or {}).get("content") for choice in event.get("choices") or [])


class Traffic:
    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, max_tokens: int) -> None:
        self.client, self.base_url, self.model, self.max_tokens = client, base_url, model, max_tokens
        self.counts = Counts()
        self.batches = BatchLedger()

    def _chat_body(self, rng: random.Random, **extra) -> dict:
        return {"model": self.model, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], **extra}

    async def _post(self, kind: str, path: str, **kwargs) -> httpx.Response | None:
        try:
            response = await self.client.post(f"{self.base_url}{path}", timeout=REQUEST_TIMEOUT_S, **kwargs)
        except httpx.HTTPError:
            self.counts.record(kind, 0)
            return None
        self.counts.record(kind, response.status_code)
        return response

    async def worker(self, seed: int, stop: asyncio.Event) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            kinds = list(KINDS)
            rng.shuffle(kinds)
            for kind in kinds:
                if stop.is_set():
                    return
                await getattr(self, kind)(rng)

    async def chat(self, rng: random.Random) -> None:
        await self._post("chat", "/chat/completions", json=self._chat_body(rng))

    async def json_schema(self, rng: random.Random) -> None:
        body = self._chat_body(rng, response_format={"type": "json_schema",
                                                     "json_schema": {"name": "record", "schema": SCHEMA}})
        await self._post("json_schema", "/chat/completions", json=body)

    async def unknown_model(self, rng: random.Random) -> None:
        await self._post("unknown_model", "/chat/completions", json={**self._chat_body(rng), "model": UNKNOWN_MODEL})

    async def malformed(self, rng: random.Random) -> None:
        choice = rng.randrange(4)
        if choice == 0:
            await self._post("malformed", "/chat/completions", content=b"{not json",
                             headers={"content-type": "application/json"})
        elif choice == 1:
            await self._post("malformed", "/chat/completions", json={"model": self.model, "messages": []})
        elif choice == 2:
            await self._post("malformed", "/chat/completions", json=self._chat_body(rng, max_tokens=-5))
        else:
            await self._post("malformed", "/batches", json={"input_file_id": "file-does-not-exist",
                                                            "endpoint": "/v1/chat/completions",
                                                            "completion_window": "24h"})

    async def _dropped(self, kind: str, path: str, body: dict) -> None:
        """Open a stream, read up to its first content chunk, then hang up."""
        try:
            async with self.client.stream("POST", f"{self.base_url}{path}", json=body,
                                          timeout=REQUEST_TIMEOUT_S) as response:
                self.counts.record(kind, response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    if line[5:].strip() == "[DONE]":
                        return
                    event = json.loads(line[5:])
                    if "error" in event or event.get("type") in ("error", "response.failed"):
                        # After the first byte a failure can only be an event: the server's own.
                        self.counts.stream_server_errors += 1
                        return
                    if has_content(event):
                        return  # hang up here, mid-answer
        except httpx.HTTPError:
            self.counts.record(kind, 0)

    async def stream_dropped(self, rng: random.Random) -> None:
        await self._dropped("stream_dropped", "/chat/completions", self._chat_body(rng, stream=True))

    async def responses_dropped(self, rng: random.Random) -> None:
        body = {"model": self.model, "input": rng.choice(PROMPTS), "max_output_tokens": self.max_tokens,
                "stream": True}
        await self._dropped("responses_dropped", "/responses", body)

    async def batch_loop(self, stop: asyncio.Event, lines: int) -> None:
        """Batches one after another until `stop`; the one running then is seen to its end."""
        batches = BatchClient(self.client, self.base_url)
        rng = random.Random(0)
        round_ = 0
        while not stop.is_set():
            ids = [f"soak-{round_}-{i}" for i in range(lines)]
            body = [{"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                     "body": self._chat_body(rng)} for custom_id in ids]
            try:
                batch = await batches.submit(body)
            except BatchRefused as refused:
                self.counts.record("batch", refused.status)
                await asyncio.sleep(1.0)
                continue
            except TargetError:
                self.counts.record("batch", 0)
                await asyncio.sleep(1.0)
                continue
            self.counts.record("batch", 200)
            self.batches.accepted[batch["id"]] = ids
            if round_ % 2:
                await self._post("batch_cancel", f"/batches/{batch['id']}/cancel")
                self.batches.cancelled += 1
            try:
                final = await batches.wait(batch["id"], time.perf_counter() + BATCH_TIMEOUT_S)
                self.batches.answered[batch["id"]] = [e.get("custom_id") for e in await batches.entries(final)]
                if final.get("status") == "cancelled" and not (final.get("request_counts") or {}).get("total"):
                    self.batches.unvalidated += 1
                    self.batches.accepted[batch["id"]] = []  # an answer to one of them would count as extra
            except (TargetError, httpx.HTTPError):
                self.counts.record("batch_poll", 0)
                final = {}
            for key in ("input_file_id", "output_file_id", "error_file_id"):
                if final.get(key):
                    await self._delete(final[key])
            round_ += 1

    async def _delete(self, file_id: str) -> None:
        try:
            response = await self.client.delete(f"{self.base_url}/files/{file_id}", timeout=60.0)
            self.counts.record("file_delete", response.status_code)
        except httpx.HTTPError:
            self.counts.record("file_delete", 0)
