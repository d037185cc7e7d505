"""Schema-constrained JSON for AR decoding through llguidance (Microsoft's low-level guidance).

llguidance compiles a JSON Schema into a grammar over bytes and, given the tokenizer's
vocabulary, computes at each step the set of tokens that keep the output a valid prefix of some
document the schema accepts (the end token only once the value is complete). Masking every
other token's logit makes the output valid by construction, as long as the token budget does
not run out first (then the finish reason is "length").

The separators are pinned to those of the canonical answer the demo models are trained on
(`json.dumps`: ", " and ": ", no other whitespace), so the mask forbids nothing the model
would write and still pins the layout to one form.

Why llguidance: a small self-contained wheel (Rust, no torch or transformers dependency),
masks in microseconds per token on CPU, and it reads a `tokenizers` tokenizer.json directly;
it is the library behind vLLM's and SGLang's guidance backends.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from torch import Tensor

from nowait.engines.base import InvalidRequestError
from nowait.tokenizer import TextCodec


@dataclass(frozen=True)
class GrammarOptions:
    item_separator: str = ", "
    key_separator: str = ": "
    whitespace_flexible: bool = False

    def compile_options(self) -> dict:
        return {"item_separator": self.item_separator, "key_separator": self.key_separator,
                "whitespace_flexible": self.whitespace_flexible}


class SchemaMatcher:
    """One request's grammar state: the allowed-token mask, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.mask_seconds = 0.0
        self.masks_computed = 0

    def allowed(self) -> Tensor:
        """Bool [vocab]: tokens allowed next. Timed: `mask_seconds` is the grammar's cost."""
        started = time.perf_counter()
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        # One bit per token, token t at bit t % 8 of byte t // 8 (llguidance's little-endian words).
        bits = np.unpackbits(packed, bitorder="little")[: self.vocab_size].astype(bool)
        self.mask_seconds += time.perf_counter() - started
        self.masks_computed += 1
        return torch.from_numpy(bits)

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"grammar rejected token {token}: {self._matcher.get_error()}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts from here, without consuming them."""
        return self._matcher.validate_tokens(tokens)

    def rollback(self, count: int) -> None:
        if count and not self._matcher.rollback(count):
            raise RuntimeError(f"grammar rollback failed: {self._matcher.get_error()}")

    def is_stopped(self) -> bool:
        """The value is complete and nothing but the end token may follow."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Schemas -> matchers for one tokenizer; compiled grammars are cached per schema."""

    def __init__(self, tokenizer_json: str, end_id: int, vocab_size: int | None = None,
                 options: GrammarOptions | None = None) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=end_id)
        self.vocab_size = vocab_size or self.tokenizer.vocab_size
        self.options = options or GrammarOptions()
        self._grammars: dict[str, str] = {}

    @classmethod
    def from_codec(cls, codec: TextCodec, vocab_size: int | None = None,
                   options: GrammarOptions | None = None, end_id: int | None = None) -> GrammarCompiler:
        """`vocab_size`: the model's (it may pad the tokenizer's vocabulary with unused rows).
        `end_id`: the checkpoint's end-of-text id (default: the demo tokenizer's end token)."""
        return cls(codec.tokenizer.to_str(), codec.end_id if end_id is None else end_id, vocab_size=vocab_size,
                   options=options)

    def grammar(self, schema: dict) -> str:
        key = json.dumps(schema)  # unsorted: property order is the order the JSON is written in
        if key not in self._grammars:
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=self.options.compile_options())
            except ValueError as error:
                raise InvalidRequestError(f"schema: not a JSON object ({error})") from None
            problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if problem and not problem.startswith("WARNING"):
                raise InvalidRequestError(f"schema: cannot be compiled to a grammar ({problem})")
            self._grammars[key] = grammar
        return self._grammars[key]

    def matcher(self, schema: dict) -> SchemaMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(schema), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"schema: {matcher.get_error()}")
        return SchemaMatcher(matcher, self.vocab_size)
