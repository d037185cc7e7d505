"""The in-process side of the load bench: one owned engine of a gateway config, no HTTP.

The engine is built exactly as the gateway builds it (`gateway.engines.build_owned`: the same
worker thread, continuous batching for AR, waves for diffusion) and driven through the same
`OwnedBackend.run` / `open_stream` the dispatcher calls. So `bench load --engine ar` against
`bench load --base-url ... --model ar` isolates what HTTP, parsing, routing and serialization
add. There is no router here: no fallback, no routing rule; the request goes to this engine.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nowait.bench.load_http import TargetError
from nowait.bench.load_metrics import EngineRun, RequestRecord
from nowait.bench.load_workload import LoadRequest

if TYPE_CHECKING:
    from nowait.gateway.config import GatewayConfig
    from nowait.gateway.domain import Attempt, Call


class InProcessEngine:
    """An owned engine loaded in this process; `request` runs one LoadRequest through it."""

    def __init__(self, config: GatewayConfig, engine: str, max_queue: int = 1024) -> None:
        from nowait.gateway.config import RemoteEngineConfig

        if engine not in config.engines:
            raise TargetError(f"engine {engine!r} is not configured (engines: {', '.join(config.engines)})")
        spec = config.engines[engine]
        if isinstance(spec, RemoteEngineConfig):
            raise TargetError(f"engine {engine!r} is a remote upstream: measure it with --base-url {spec.base_url}")
        # An open-loop (Poisson) run may queue far more than the engine's default back-pressure
        # allows; the bench measures the engine's latency under load, not its 429s.
        self.spec = spec.model_copy(update={"max_queue": max(spec.max_queue, max_queue)})
        self.name, self.config = engine, config
        self.backend = None
        self._counter = 0

    @property
    def kind(self) -> str:
        return self.spec.kind

    def load(self) -> None:
        """Load the model (blocking: seconds); TargetError when it cannot serve."""
        from nowait.gateway.engines import ModelCache, build_owned

        backend = build_owned(self.name, self.spec, ModelCache(), self.config.metrics_window_s,
                              self.config.defaults.max_tokens)
        if not backend.available:
            raise TargetError(f"engine {self.name!r} is not available: {backend.unavailable_reason}")
        self.backend = backend

    async def start(self) -> None:
        if self.backend is None:
            self.load()
        await self.backend.start()

    async def stop(self) -> None:
        if self.backend is not None:
            await self.backend.stop()

    def _call(self, request: LoadRequest) -> Call:
        from nowait.gateway.calls import chat_calls
        from nowait.gateway.schemas import ChatCompletionRequest

        self._counter += 1
        body = ChatCompletionRequest.model_validate(request.body(self.name, stream=False))
        [call] = chat_calls(body, request.metadata.headers(), self.config.defaults, f"load-{self._counter}")
        return call

    def _finish(self, record: RequestRecord, request: LoadRequest, attempt: Attempt, text: str) -> RequestRecord:
        record.prompt_tokens, record.output_tokens = attempt.prompt_tokens, attempt.completion_tokens
        record.cached_prompt_tokens = attempt.cached_prompt_tokens
        record.engine, record.cost_usd = self.name, attempt.cost_usd
        record.attempts = (EngineRun(engine=self.name, seconds=attempt.seconds, prompt_tokens=attempt.prompt_tokens,
                                     completion_tokens=attempt.completion_tokens, forwards=attempt.forwards,
                                     outcome=attempt.outcome),)
        record.score = request.score(text)
        return record

    async def request(self, request: LoadRequest, t0: float, timeout_s: float, stream: bool = True,
                      label: str = "") -> RequestRecord:
        """One request through the engine's worker, timed like the HTTP client times it."""
        from nowait.gateway.errors import APIError

        record = RequestRecord(target=self.name, sent_s=time.perf_counter() - t0, done_s=0.0,
                               latency_target_s=request.latency_target_s, label=label)
        try:
            call = self._call(request)
            if not stream:
                attempt = await self.backend.run(call, timeout_s)
                record.done_s = record.first_token_s = time.perf_counter() - t0
                return self._finish(record, request, attempt, attempt.text)
            opened = await self.backend.open_stream(call, timeout_s)
            pieces = []
            try:
                async for text in opened.deltas():
                    if text and record.first_token_s is None:
                        record.first_token_s = time.perf_counter() - t0
                    pieces.append(text)
            finally:
                await opened.aclose()
            record.done_s = time.perf_counter() - t0
            return self._finish(record, request, opened.attempt, "".join(pieces))
        except APIError as error:
            record.status, record.error = error.status, error.message
        except Exception as error:  # a bug in one request must not end the run; it is counted
            record.status, record.error = 500, f"{type(error).__name__}: {error}"
        record.done_s = time.perf_counter() - t0
        return record
