"""Engine token logprobs -> OpenAI's logprobs objects, for whole answers and stream deltas.

An engine returns ids and numbers (`nowait.engines.base.TokenLogprob`); the client wants each
token's text and UTF-8 bytes, and, on legacy completions, where it starts in the text:

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
                  "refusal": null}
    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
                  "text_offset": [...]}

A token's bytes are its vocabulary entry's bytes (byte-level BPE pieces mapped back to bytes,
<0xNN> byte-fallback pieces to their byte, "▁" to a space), so the bytes of an answer's tokens
concatenate to its UTF-8 text; a token that is part of a multi-byte character writes its bytes
as \\xNN in `token`, as OpenAI does. Special tokens are written as themselves but add nothing to
the text (the engines decode without them).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import decoders

from nowait.engines.base import TokenLogprob
from nowait.engines.structured.token_automaton import byte_level_decoding
from nowait.tokenizer import TextCodec

BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


BYTE_LEVEL = byte_level_decoding()  # byte-level BPE's alphabet -> the byte each char stands for


@dataclass(frozen=True)
class TokenText:
    token: str  # as OpenAI writes it: the text, or \xNN for bytes that are not a whole character
    bytes: list[int]
    text_bytes: bytes  # what it adds to the answer's text (nothing for a special token)


class TokenTexts:
    """Each id's text and bytes under one tokenizer, looked up once."""

    def __init__(self, codec: TextCodec) -> None:
        self.tokenizer = codec.tokenizer
        self.byte_level = isinstance(self.tokenizer.decoder, decoders.ByteLevel)
        self.special = {i for i, added in self.tokenizer.get_added_tokens_decoder().items() if added.special}
        self._known: dict[int, TokenText] = {}

    def of(self, token_id: int) -> TokenText:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._look_up(token_id)
        return known

    def _look_up(self, token_id: int) -> TokenText:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:  # a padded vocabulary's id with no entry
            return TokenText("", [], b"")
        if token_id in self.special:
            raw = piece.encode()
            return TokenText(piece, list(raw), b"")
        fallback = BYTE_PIECE.match(piece)
        if fallback:
            raw = bytes([int(fallback.group(1), 16)])
        elif self.byte_level and all(ch in BYTE_LEVEL for ch in piece):
            raw = bytes(BYTE_LEVEL[ch] for ch in piece)
        else:
            raw = piece.replace("\u2581", " ").encode()
        return TokenText(raw.decode("utf-8", errors="backslashreplace"), list(raw), raw)


@dataclass(frozen=True)
class LogprobEntry:
    """One output token as the client sees it: text, logprob, where it starts, its alternatives."""

    text: TokenText
    logprob: float
    offset: int  # characters of the answer before it
    top: tuple[tuple[TokenText, float], ...]


class EntryBuilder:
    """Entries for an answer's tokens in order, as they arrive (offsets carry over)."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.entries: list[LogprobEntry] = []

    def add(self, items: Iterable[TokenLogprob]) -> list[LogprobEntry]:
        new = []
        for item in items:
            text = self.texts.of(item.token_id)
            raw = text.text_bytes
            # Bytes left pending by the tokens before (half a character) that this token does not
            # continue become one U+FFFD in the text, as the tokenizer decodes: this token starts after it.
            broken = bool(self._utf8.getstate()[0]) and bool(raw) and not 0x80 <= raw[0] <= 0xBF
            new.append(LogprobEntry(text, item.logprob, self.chars + broken,
                                    tuple((self.texts.of(i), lp) for i, lp in item.top)))
            self.chars += len(self._utf8.decode(raw))
        self.entries += new
        return new


def answer_entries(texts: TokenTexts, items: list[TokenLogprob] | None, text: str) -> list[LogprobEntry] | None:
    """The entries of a whole answer; when the text was cut short (a stop string), the tokens
    that start after the cut are dropped with it."""
    if items is None:
        return None
    builder = EntryBuilder(texts)
    entries = builder.add(items)
    return within(entries, len(text)) if len(text) < builder.chars else entries


def within(entries: list[LogprobEntry], chars: int) -> list[LogprobEntry]:
    return [e for e in entries if e.offset < chars]


class StreamLogprobs:
    """The entries a stream has not sent yet: each delta takes those of the tokens whose text
    starts in what has been sent (a token cut by a stop string is never sent)."""

    def __init__(self, texts: TokenTexts) -> None:
        self.builder = EntryBuilder(texts)
        self.fed = 0  # engine items seen
        self.sent = 0  # entries sent

    def take(self, items: list[TokenLogprob] | None, sent_chars: int, final: bool = False) -> list[LogprobEntry]:
        """`items`: every logprob of the answer so far; `sent_chars`: the text sent, this delta included."""
        items = items or []
        self.builder.add(items[self.fed:])
        self.fed = max(self.fed, len(items))
        pending = self.builder.entries[self.sent:]
        if not final or sent_chars < self.builder.chars:
            pending = within(pending, sent_chars)
        self.sent += len(pending)
        return pending


class TextWithLogprobs(str):
    """A stream's text delta with the logprob entries of its tokens. A str, so everything that
    relays text deltas relays it unchanged; the chunk writer reads `logprobs`."""

    logprobs: list[LogprobEntry]

    def __new__(cls, text: str, logprobs: list[LogprobEntry]) -> TextWithLogprobs:
        delta = super().__new__(cls, text)
        delta.logprobs = logprobs
        return delta


def delta_logprobs(delta: str) -> list[LogprobEntry] | None:
    return getattr(delta, "logprobs", None)


# --- OpenAI's shapes ---


def _choice(text: TokenText, logprob: float) -> dict:
    return {"token": text.token, "logprob": logprob, "bytes": text.bytes}


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    """`choices[i].logprobs` of a chat completion (or chunk)."""
    return {"content": [_choice(e.text, e.logprob) | {"top_logprobs": [_choice(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[LogprobEntry]) -> dict:
    """`choices[i].logprobs` of a legacy completion: OpenAI's top_logprobs always hold the
    sampled token too, so a dict has up to `logprobs` + 1 keys."""
    top = []
    for e in entries:
        alternatives = {t.token: lp for t, lp in e.top}
        alternatives.setdefault(e.text.token, e.logprob)
        top.append(alternatives)
    return {"tokens": [e.text.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": [e.offset for e in entries]}
