"""The engine for DiffusionGemma checkpoints: the reference's block decode behind the Engine protocol.

Requests run one after another (`max_batch` 1: the reference decodes a batch in lockstep, every
row waiting for the slowest block, which a server would not want either), each through
`generate_diffusion_gemma` with the checkpoint's sampler settings (generation_config.json over
the reference's defaults). Streaming sends each block's text once the block is final.

- Seeds: the sampler is random by construction (a random canvas, re-noising), so a request's
  `seed` seeds its generator (the same seed gives the same answer, and transformers' tokens);
  without one each request draws its own. `temperature`, `top_p` and `top_k` do not apply: the
  checkpoint's temperature schedule does; a `top_p` or `top_k` is refused rather than ignored.
- Confidence for the router: the minimum, over the answer's tokens and the end token that closed
  it, of the model's probability (temperature 1) of each token under the block's last denoising
  step: "min_token_probability", the same kind the masked-diffusion engine reports, so one
  fallback threshold reads both. The sampler's own signal (entropy) is what accepted the
  tokens, but a low-temperature argmax is near-certain by construction; the unscaled
  probability still says when the model was unsure.
- Logprobs, when asked: the log of those same probabilities (the last step's log-softmax at
  temperature 1, its top alternatives with it), computed from the logits already there.
- Schema templates are refused ("schema: ..."), which lets the dispatcher re-run the request on
  an AR engine: the reference sampler has no fixed positions (every canvas position is
  re-noised uniformly until accepted), and clamping template tokens into a canvas is a
  departure from it that has not been measured yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from nowait.engines.base import Completion, GenerationRequest, InvalidRequestError, StreamChunk, Timings, TokenLogprob
from nowait.engines.diffusion.gemma_sampler import (
    GemmaBlock,
    GemmaDecode,
    GemmaSampling,
    answer_of,
    decode_blocks,
    generate_diffusion_gemma,
)
from nowait.model.diffusion_gemma import DiffusionGemma
from nowait.tokenizer import TextCodec

# Per-request settings (GenerationRequest.options) the engine takes, over the checkpoint's.
SAMPLING_OPTIONS = ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold",
                    "confidence_threshold")


class DiffusionGemmaEngine:
    kind = "diffusion"
    max_batch = 1

    def __init__(self, model: DiffusionGemma, codec: TextCodec, sampling: GemmaSampling | None = None,
                 name: str = "diffusion", *, end_ids: Sequence[int]) -> None:
        if not end_ids:
            raise ValueError("DiffusionGemma needs the checkpoint's end ids")
        self.model = model.eval()
        self.codec = codec
        self.sampling = sampling or GemmaSampling()
        self.name = name
        self.end_ids = tuple(end_ids)

    def plan(self, request: GenerationRequest) -> GemmaSampling:
        """Validate a request (InvalidRequestError); the sampler settings it runs with."""
        request.sampling.validate()
        if request.schema is not None:
            raise InvalidRequestError("schema: DiffusionGemma's sampler has no fixed canvas positions to hold a "
                                      "template (each position is re-noised until accepted); use an AR engine")
        if request.sampling.top_p < 1 or request.sampling.top_k:
            raise InvalidRequestError("top_p and top_k do not apply to DiffusionGemma's entropy-bound sampler")
        if not request.prompt_ids:
            raise InvalidRequestError("prompt_ids is empty: DiffusionGemma's encoder needs a prompt")
        config = self.model.config
        if not all(0 <= t < config.vocab_size for t in request.prompt_ids):
            raise InvalidRequestError(f"prompt_ids must be token ids in [0, {config.vocab_size})")
        image = config.extra.get("image_token_id")
        if image is not None and image in request.prompt_ids:
            raise InvalidRequestError("image tokens: nowait runs DiffusionGemma's text model only (no vision tower)")
        if not isinstance(request.options, dict):
            raise InvalidRequestError("options must be a dict of DiffusionGemma sampler settings")
        unknown = sorted(set(request.options) - set(SAMPLING_OPTIONS))
        if unknown:
            raise InvalidRequestError(f"options {unknown} do not apply to DiffusionGemma "
                                      f"(it takes {', '.join(SAMPLING_OPTIONS)})")
        try:
            sampling = GemmaSampling(**{**self.sampling.__dict__, **request.options})
        except TypeError as error:
            raise InvalidRequestError(f"options: {error}") from None
        if sampling.max_denoising_steps < 1 or sampling.entropy_bound <= 0 or not 0 <= sampling.t_min < sampling.t_max:
            raise InvalidRequestError("options: max_denoising_steps >= 1, entropy_bound > 0 and 0 <= t_min < t_max")
        return sampling

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        plans = [self.plan(request) for request in requests]  # refuse bad requests before any work
        return [self._run(request, sampling) for request, sampling in zip(requests, plans, strict=True)]

    def stream(self, request: GenerationRequest) -> Iterator[StreamChunk]:
        """One chunk per finished block; the last carries the Completion."""
        sampling = self.plan(request)  # raised here, not at the first next()
        return self._stream(request, sampling)

    def _stream(self, request: GenerationRequest, sampling: GemmaSampling) -> Iterator[StreamChunk]:
        blocks: list[GemmaBlock] = []
        sent_text, sent_ids = "", 0
        max_tokens = request.sampling.max_tokens
        for block in decode_blocks(self.model, list(request.prompt_ids), max_tokens, self.end_ids, sampling,
                                   self._generator(request), request.sampling.logprobs):
            blocks.append(block)
            partial = answer_of(blocks, max_tokens, self.end_ids).tokens
            text = self.codec.decode(partial)
            if text.endswith("\ufffd"):  # a block ended inside a UTF-8 character: wait for the rest
                continue
            if len(text) > len(sent_text) and text.startswith(sent_text):
                logprobs = block_logprobs(blocks)
                yield StreamChunk(text=text[len(sent_text):], token_ids=partial[sent_ids:],
                                  logprobs=None if logprobs is None else logprobs[sent_ids:len(partial)])
                sent_text, sent_ids = text, len(partial)
        completion = self._completion(request, answer_of(blocks, max_tokens, self.end_ids))
        yield StreamChunk(text=completion.text[len(sent_text):], token_ids=completion.token_ids[sent_ids:],
                          completion=completion,
                          logprobs=None if completion.logprobs is None else completion.logprobs[sent_ids:])

    def _generator(self, request: GenerationRequest) -> torch.Generator:
        generator = torch.Generator(device=self.model.embed_tokens.weight.device)
        if request.sampling.seed is not None:
            generator.manual_seed(request.sampling.seed % 2**64)
        else:
            generator.seed()
        return generator

    def _run(self, request: GenerationRequest, sampling: GemmaSampling) -> Completion:
        decode = generate_diffusion_gemma(self.model, list(request.prompt_ids), request.sampling.max_tokens,
                                          self.end_ids, sampling, self._generator(request), request.sampling.logprobs)
        return self._completion(request, decode)

    def _completion(self, request: GenerationRequest, decode: GemmaDecode) -> Completion:
        probabilities = [p for block in decode.blocks for p in block.probabilities.tolist()]
        deciding = probabilities[: len(decode.tokens) + (1 if decode.finish_reason == "stop" else 0)]
        now = time.perf_counter() - request.arrival_time
        logprobs = block_logprobs(decode.blocks)
        return Completion(
            request_id=request.request_id, engine=self.name, token_ids=list(decode.tokens),
            text=self.codec.decode(decode.tokens), finish_reason=decode.finish_reason,
            prompt_tokens=len(request.prompt_ids), token_confidences=probabilities[: len(decode.tokens)],
            confidence=min(deciding, default=1.0), confidence_kind="min_token_probability",
            forwards=decode.forwards, timings=Timings(first_token_s=now, total_s=now),
            ended_by_end_token=decode.finish_reason == "stop",
            logprobs=None if logprobs is None else logprobs[: len(decode.tokens)])


def block_logprobs(blocks: list[GemmaBlock]) -> list[TokenLogprob] | None:
    """The blocks' token logprobs in answer order (None when the request did not ask)."""
    if not blocks or blocks[0].logprobs is None:
        return None
    return [entry for block in blocks for entry in block.logprobs]
