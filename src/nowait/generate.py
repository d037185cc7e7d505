"""One prompt through a loaded checkpoint's engine: what `nowait generate` runs.

The engine is the one the checkpoint is (AR for a causal model, diffusion for a bidirectional
one, unless `load_pretrained(engine=...)` overrode it), built with the checkpoint's own
conventions: its end-of-text ids, its mask token and logit shift (in the model config), and
its chat template for the prompt.
"""

from __future__ import annotations

import time

from nowait.checkpoints import LoadedModel
from nowait.conventions import apply_chat_template, encode_prompt
from nowait.engines.ar import AutoregressiveEngine, EngineConfig
from nowait.engines.base import Completion, GenerationRequest, InvalidRequestError, SamplingParams
from nowait.engines.config import ArEngineConfig, DiffusionEngineConfig
from nowait.engines.diffusion import DiffusionEngine, DiffusionOptions
from nowait.engines.factory import EngineModel, engine_from


def checkpoint_engine(loaded: LoadedModel, max_model_len: int | None = None, max_batch: int = 1,
                      options: DiffusionOptions | None = None) -> AutoregressiveEngine | DiffusionEngine:
    """The engine of the checkpoint's kind, from the engine factory, sized for `max_batch`
    sequences of at most `max_model_len` tokens (an AR cache row is allocated for that many up
    front), stopping on the checkpoint's own end ids."""
    if loaded.engine_kind == "ar":
        # The AR engine's own token budget per step: a long prompt is prefilled as it always was.
        config = ArEngineConfig(kind="ar", max_num_seqs=max_batch, max_model_len=max_model_len, structured=False,
                                max_num_batched_tokens=max(max_batch, EngineConfig.max_num_batched_tokens))
    else:
        config = DiffusionEngineConfig.with_options(options or DiffusionOptions(), max_batch)
    return engine_from(config, EngineModel.of(loaded), where=str(loaded.path))


def prompt_ids(loaded: LoadedModel, prompt: str, chat: bool = True) -> list[int]:
    """The prompt as one user turn of the checkpoint's chat template (when it has one and `chat`),
    else the text as is."""
    conventions = loaded.conventions
    if chat and conventions.chat_template is not None:
        text = apply_chat_template(conventions, [{"role": "user", "content": prompt}])
        return encode_prompt(loaded.codec, text, templated=True)
    return encode_prompt(loaded.codec, prompt, templated=False)


def generate_once(loaded: LoadedModel, prompt: str, max_tokens: int, temperature: float = 0.0,
                  seed: int | None = None, chat: bool = True) -> tuple[Completion, float]:
    """Generate up to `max_tokens` for one prompt (greedy at temperature 0); the Completion and
    the wall seconds. Raises InvalidRequestError for a request the model cannot hold."""
    ids = prompt_ids(loaded, prompt, chat)
    if not ids:  # refused before an engine is sized for it: a row holds a prompt token at least
        raise InvalidRequestError("the prompt is empty: the model needs at least one token to continue")
    room = loaded.model.config.max_position
    if len(ids) + max_tokens > room:
        raise InvalidRequestError(f"the prompt is {len(ids)} tokens; with max_tokens {max_tokens} that exceeds the "
                                  f"model's {room} positions")
    engine = checkpoint_engine(loaded, max_model_len=len(ids) + max_tokens)
    # The engine stops on every end id of the checkpoint (Llama 3 Instruct: <|eot_id|> beside
    # <|end_of_text|>): `checkpoint_engine` gives it them all.
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    started = time.perf_counter()
    [completion] = engine.generate([GenerationRequest(ids, sampling)])
    return completion, time.perf_counter() - started


def completion_record(loaded: LoadedModel, completion: Completion, seconds: float, dtype: str,
                      device: str) -> dict:
    """The JSON `nowait generate --json` prints: `text` and `token_ids` (generated ids only)."""
    return {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "engine": loaded.engine_kind,
        "model": str(loaded.path),
        "architecture": (loaded.hf_config.get("architectures") or ["?"])[0],
        "dtype": dtype,
        "device": device,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "forwards": completion.forwards,
        "seconds": round(seconds, 4),
    }
