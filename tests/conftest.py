"""Shared fixtures: one small tokenizer for the session and a factory of tiny, sensitive models."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from itertools import islice

import pytest
import torch
from tokenizers import Tokenizer

from nowait.extraction.corpus import training_stream
from nowait.model import ModelConfig, Transformer
from nowait.tokenizer import END, TextCodec, extraction_prompt, train_tokenizer

torch.set_num_threads(1)

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            max_position=512)


def build_model(seed: int = 0, **overrides) -> Transformer:
    """A tiny Transformer whose weights are large enough that every path moves the logits.

    The library's 0.02 init makes attention contributions so small at hidden size 32 that a
    wrong mask could hide under a 1e-5 tolerance; here linears get std 1/sqrt(fan_in), norms
    and biases are perturbed, so a difference in what a position attends to shows as O(0.1).
    """
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif parameter.dim() == 1:  # qkv biases
                parameter.normal_(0.0, 0.3)
            else:
                parameter.normal_(0.0, 1 / math.sqrt(parameter.shape[1]))
    return model.eval()


@pytest.fixture
def make_model() -> Callable[..., Transformer]:
    return build_model


@pytest.fixture(scope="session")
def codec() -> TextCodec:
    """BPE (vocab 400) on 300 training documents, as `build_tokenizer` builds the real one."""
    texts = [extraction_prompt(doc.kind, doc.text) + doc.answer_json() + END
             for doc in islice(training_stream(0), 300)]
    return TextCodec(train_tokenizer(texts, vocab_size=400))


def swapped_codec(codec: TextCodec) -> TextCodec:
    """`codec` with two ordinary tokens trading ids: a tokenizer of the same size whose ids mean
    something else, as after retraining a tokenizer (a draft trained on one misreads the other)."""
    data = json.loads(codec.tokenizer.to_str())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]  # the last two merges: no special token
    vocab[first], vocab[second] = vocab[second], vocab[first]
    return TextCodec(Tokenizer.from_str(json.dumps(data)))


def _started_postgres():
    """A private PostgreSQL server, started (fails, never skips, when PostgreSQL is missing)."""
    from nowait.store.scratch_postgres import PostgresNotFound, ScratchPostgres

    try:
        return ScratchPostgres().start()
    except PostgresNotFound as error:
        pytest.fail(f"the PostgreSQL store's tests need a PostgreSQL server: {error}", pytrace=False)


@pytest.fixture(scope="session")
def postgres_server():
    """One private PostgreSQL server for the session."""
    server = _started_postgres()
    yield server
    server.close()


@pytest.fixture
def private_postgres():
    """A PostgreSQL server of one test's own, which the test may stop and restart."""
    server = _started_postgres()
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    """The store URL of a test run on both stores: a SQLite file, then a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.sqlite'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def postgres_url(postgres_server, request) -> str:
    """A fresh, empty database on the session's PostgreSQL server, for one test."""
    import re
    import uuid

    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:40] + "_" + uuid.uuid4().hex[:8]
    return postgres_server.create_database(name)
