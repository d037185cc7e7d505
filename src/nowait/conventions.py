"""What a checkpoint says about talking to it: end-of-text ids, mask token, BOS, chat template.

Read from the files a Hugging Face directory ships, never assumed by an engine: Llama 3 Instruct
ends a turn with <|eot_id|> (generation_config lists it beside <|end_of_text|>), Qwen2.5 with
<|im_end|>, LLaDA masks with id 126336 and Dream with 151666, and each has its own chat template.
The demo checkpoints written by `save_pretrained` carry the same files, so one path serves both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from nowait.checkpoint_files import CheckpointError, read_json
from nowait.model import ModelConfig
from nowait.tokenizer import MASK, TextCodec

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")


@dataclass(frozen=True)
class ModelConventions:
    """`end_ids`: generation stops at any of them; the first also pads. `nowait_prompt`: a demo
    checkpoint trained on `nowait.tokenizer.render_chat`'s prompt shape (the gateway folds a
    conversation into it) rather than on a chat template of its own."""

    end_ids: tuple[int, ...]
    mask_id: int | None = None
    bos_id: int | None = None
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    nowait_prompt: bool = False

    @property
    def end_id(self) -> int:
        return self.end_ids[0]


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_chat_template(directory: Path, tokenizer_config: dict) -> str | None:
    """tokenizer_config.json's `chat_template` (a string, or named templates: the default one),
    else chat_template.jinja (where transformers >= 4.47 writes it)."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    path = directory / "chat_template.jinja"
    return path.read_text(encoding="utf-8") if path.is_file() else None


def read_conventions(directory: Path, hf: dict, generation: dict, codec: TextCodec,
                     config: ModelConfig) -> ModelConventions:
    """The conventions of a checkpoint directory whose config.json (`hf`), generation_config.json
    and tokenizer are already read; tokenizer_config.json is optional."""
    tokenizer_config = read_json(directory / "tokenizer_config.json", required=False)
    special = {key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(tokenizer_config.get(key)))}

    def token_id(key: str) -> int | None:
        return codec.tokenizer.token_to_id(special[key]) if key in special else None

    # generation_config.json first: it is what Hugging Face's own generate() stops on.
    candidates = [*_ids(generation.get("eos_token_id")), *_ids(hf.get("eos_token_id")), token_id("eos_token")]
    end_ids = tuple(dict.fromkeys(i for i in candidates if i is not None and 0 <= i < config.vocab_size))
    if not end_ids:
        if codec.end_id is None:
            raise CheckpointError(f"{directory}: no end-of-text token (set eos_token_id in generation_config.json "
                                  "or config.json, or eos_token in tokenizer_config.json)")
        end_ids = (codec.end_id,)
    mask_id = config.mask_token_id
    if mask_id is None:
        mask_id = token_id("mask_token")
    if mask_id is None:
        mask_id = codec.tokenizer.token_to_id(MASK)
    bos_id = token_id("bos_token")
    if bos_id is None:
        bos_id = next(iter(_ids(generation.get("bos_token_id")) + _ids(hf.get("bos_token_id"))), None)
    return ModelConventions(end_ids=end_ids, mask_id=mask_id, bos_id=bos_id,
                            chat_template=read_chat_template(directory, tokenizer_config),
                            special_tokens=special, nowait_prompt="nowait" in hf)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str):
    # The environment Hugging Face renders chat templates in (sandboxed, trim/lstrip blocks,
    # loop controls, raise_exception, strftime_now, tojson without ASCII escaping), so a
    # checkpoint's template gives the same prompt text here as in transformers.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(template)


def apply_chat_template(conventions: ModelConventions, messages: list[dict[str, str]],
                        add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation under the checkpoint's own chat template."""
    if conventions.chat_template is None:
        raise ValueError("this checkpoint has no chat template (tokenizer_config.json chat_template)")
    from jinja2 import TemplateError

    try:
        return _compile(conventions.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **conventions.special_tokens)
    except TemplateError as error:
        raise ValueError(f"the checkpoint's chat template failed: {error}") from None


def encode_prompt(codec: TextCodec, text: str, templated: bool) -> list[int]:
    """Token ids of a prompt. A chat template writes its own special tokens (BOS included), so
    its text is encoded as is; raw text gets what the tokenizer adds itself (Llama 3: BOS)."""
    return codec.tokenizer.encode(text, add_special_tokens=not templated).ids
