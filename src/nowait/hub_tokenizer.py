"""A checkpoint's tokenizer from its files: tokenizer.json, or Qwen2's vocab.json and merges.txt.

Dream's published repositories (Dream-org/Dream-v0-Instruct-7B) ship only the files of the
Python-side Qwen2 tokenizer: `vocab.json`, `merges.txt` and a `tokenizer_config.json` whose
`added_tokens_decoder` lists the special tokens by id. The same tokenizer is built here with the
`tokenizers` library, exactly as transformers' `Qwen2Tokenizer` builds it from those two files
(models/qwen2/tokenization_qwen2.py): byte-level BPE with no unknown token, NFC normalization,
Qwen2's split regex before the byte-level mapping, and a byte-level decoder; the added tokens
then take the ids tokenizer_config.json gives them.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from nowait.checkpoint_files import CheckpointError, read_json

# transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX (the one in Qwen2's own tokenizer.json).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen2_tokenizer(vocab_path: Path, merges_path: Path, tokenizer_config: dict) -> Tokenizer:
    """The fast tokenizer of Qwen2's vocab.json + merges.txt, with the added tokens of
    tokenizer_config.json at their stated ids (a file whose ids cannot be kept is refused)."""
    vocab, merges = models.BPE.read_file(str(vocab_path), str(merges_path))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    add_prefix_space = bool(tokenizer_config.get("add_prefix_space") or False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    for token_id, entry in sorted(added_tokens(tokenizer_config).items()):
        token = AddedToken(entry["content"], single_word=bool(entry.get("single_word", False)),
                           lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                           normalized=bool(entry.get("normalized", False)), special=bool(entry.get("special", True)))
        # Added in id order, each one lands on the next free id: the one the file states, unless
        # the file skips ids, which `tokenizers` cannot represent.
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(entry["content"])
        if got != token_id:
            raise CheckpointError(f"tokenizer_config.json: added token {entry['content']!r} has id {token_id}, "
                                  f"but follows a vocabulary that puts it at {got}")
    return tokenizer


def added_tokens(tokenizer_config: dict) -> dict[int, dict]:
    """tokenizer_config.json's `added_tokens_decoder` ({"151643": {"content": ...}, ...}) by id."""
    entries = tokenizer_config.get("added_tokens_decoder") or {}
    try:
        return {int(key): value for key, value in entries.items() if isinstance(value, dict) and "content" in value}
    except ValueError:
        raise CheckpointError("tokenizer_config.json: added_tokens_decoder keys must be token ids") from None


def read_tokenizer(directory: Path) -> Tokenizer:
    """tokenizer.json when the directory has one, else vocab.json + merges.txt (Qwen2's BPE)."""
    if (directory / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if vocab.is_file() and merges.is_file():
        tokenizer_config = read_json(directory / "tokenizer_config.json", required=False)
        stated = tokenizer_config.get("tokenizer_class")
        if stated not in (None, "Qwen2Tokenizer", "Qwen2TokenizerFast"):
            raise CheckpointError(f"{directory}: no tokenizer.json, and vocab.json + merges.txt are read as "
                                  f"Qwen2's tokenizer only (tokenizer_config.json names {stated!r})")
        try:
            return qwen2_tokenizer(vocab, merges, tokenizer_config)
        except CheckpointError as error:
            raise CheckpointError(f"{directory}: {error}") from None
    raise CheckpointError(f"{directory}: missing tokenizer.json (or Qwen2's vocab.json and merges.txt)")
