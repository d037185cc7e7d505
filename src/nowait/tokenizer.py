"""The demo tokenizer and the one prompt template every engine shares.

BPE from the `tokenizers` library over a pre-tokenizer that keeps letter runs, single digits
and runs of punctuation/space apart. A value such as "Okafor" or "1985" is then split into the
same tokens in the document and in the JSON answer, so extraction becomes copying token ids,
which a small model learns far sooner than copying through different segmentations.
Byte-level symbols underneath mean any UTF-8 text (a pasted document with "€") encodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from nowait.extraction.corpus import Document
from nowait.extraction.instructions import default_instruction

END = "<|endoftext|>"  # end of answer, and padding
MASK = "<|mask|>"  # the masked-diffusion mask token
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [END, MASK, SYSTEM, USER, ASSISTANT]

# letter runs | one digit | runs of layout/JSON glue (whitespace " : , { } [ ]) | any other
# single character. A capital letter next to another capital is its own token, so codes
# (USD, EUR, KYC, IBAN letters) are spelled letter by letter: a merged "USD" token is seen too
# rarely next to its copy for the model to learn to tell ten such codes apart, while single
# letters are copied everywhere. Glue never occurs inside a value, so BPE cannot merge across a value's
# edge: "+44..." after ": " and after '": "' starts with the same "+" token, "S.A." before
# "\n" and before '", "' ends with the same "." token.
PRE_TOKEN_PATTERN = r'\p{Lu}(?=\p{Lu})|(?<=\p{Lu})\p{Lu}|\p{L}+|\p{N}|[\s":,{}\[\]]+|[^\p{L}\p{N}\s":,{}\[\]]'


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> Tokenizer:
    """Train the BPE vocabulary on `texts` (documents and their JSON answers)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def instruction_for(kind: str) -> str:
    """The default wording (the clean tier's); others: `nowait.extraction.instructions`."""
    return default_instruction(kind)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The chat template: each message as <|role|>content, then <|assistant|> to answer."""
    roles = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
    text = "".join(f"{roles[m['role']]}{m['content']}" for m in messages)
    return text + (ASSISTANT if add_generation_prompt else "")


def extraction_prompt(kind: str, document: str, instruction: str | None = None) -> str:
    """The prompt the demo models are trained on: the instruction (default: the one naming the
    kind), then the document, in one user turn; `nowait.gateway.prompts.chat_prompt` folds a
    system instruction and a user document into this same text."""
    content = f"{instruction or instruction_for(kind)}\n{document}\n"
    return render_chat([{"role": "user", "content": content}])


def document_prompt(document: Document) -> str:
    """The prompt for a corpus document, in the wording it carries (hard tier) or the default."""
    return extraction_prompt(document.kind, document.text, document.instruction or None)


@dataclass
class TextCodec:
    """A tokenizer with the ids the engines need (end, mask) resolved once."""

    tokenizer: Tokenizer

    @property
    def end_id(self) -> int:
        return self.tokenizer.token_to_id(END)

    @property
    def mask_id(self) -> int:
        return self.tokenizer.token_to_id(MASK)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def same_ids_as(self, other: TextCodec) -> bool:
        """Both tokenizers map every token to the same id (models trained on either can share ids)."""
        return self.tokenizer.get_vocab(True) == other.tokenizer.get_vocab(True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path) -> TextCodec:
        return cls(Tokenizer.from_file(str(path)))
