"""Training objectives, batches and the learning-rate schedule."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from nowait.engines.diffusion.reference import window_logits
from nowait.extraction.corpus import documents
from nowait.model import ModelConfig, Transformer
from nowait.tokenizer import extraction_prompt
from nowait.training import (
    TrainSettings,
    ar_batch,
    ar_loss,
    curriculum,
    diffusion_batch,
    diffusion_loss,
    learning_rate_at,
)

TINY = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def fit(model: Transformer, loss_fn, batch, steps: int = 30, lr: float = 1e-2) -> tuple[float, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    with torch.no_grad():
        initial = float(loss_fn(model, batch)[0])
    for _ in range(steps):
        loss, _ = loss_fn(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        final = float(loss_fn(model, batch)[0])
    return initial, final


def test_ar_loss_decreases(codec):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=codec.vocab_size, **TINY))
    batch = ar_batch(documents("validation", 3), codec, document_weight=0.5)
    initial, final = fit(model, ar_loss, batch)
    uniform = torch.log(torch.tensor(float(codec.vocab_size))).item()
    assert initial == pytest.approx(1.5 * uniform, abs=0.5)  # answer + 0.5 * document, both near uniform
    assert final < initial - 1.5


def test_diffusion_loss_decreases(codec):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=codec.vocab_size, causal=False, logits_shift=True,
                                    mask_token_id=codec.mask_id, **TINY))
    batch = diffusion_batch(documents("validation", 3), codec, window=48,
                            generator=torch.Generator().manual_seed(0))
    assert batch[4].any()
    initial, final = fit(model, diffusion_loss, batch)
    assert final < 0.7 * initial


def test_ar_batch_weights(codec):
    docs = documents("test", 3)
    inputs, targets, answer, document = ar_batch(docs, codec, document_weight=0.25)
    sequences = []
    for doc in docs:
        prompt = codec.encode(extraction_prompt(doc.kind, doc.text))
        sequences.append((prompt, [*codec.encode(doc.answer_json()), codec.end_id]))
    length = max(len(p) + len(a) for p, a in sequences) - 1
    assert inputs.shape == targets.shape == answer.shape == document.shape == (3, length)
    for row, (prompt, answer_ids) in enumerate(sequences):
        full = prompt + answer_ids
        n = len(full) - 1
        assert inputs[row, :n].tolist() == full[:-1]
        assert targets[row, :n].tolist() == full[1:]
        answer_targets = targets[row, answer[row] == 1].tolist()
        assert answer_targets == answer_ids  # every answer token, the end token included
        assert answer[row, :n].sum() == len(answer_ids)
        assert set(answer[row].unique().tolist()) <= {0.0, 1.0}
        assert document[row, : len(prompt) - 1].eq(0.25).all()
        assert document[row, len(prompt) - 1:].eq(0).all()
        assert (answer[row] * document[row]).eq(0).all()
        assert answer[row, n:].eq(0).all() and document[row, n:].eq(0).all()  # padding
        assert inputs[row, n:].eq(codec.end_id).all()
    assert min(len(p) + len(a) - 1 for p, a in sequences) < length, "some row must be padded"


def test_ar_loss_ignores_padding_and_weights_document(codec):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=codec.vocab_size, **TINY)).eval()
    batch = ar_batch(documents("test", 2), codec, document_weight=0.5)
    inputs, targets, answer, document = batch
    with torch.no_grad():
        loss, parts = ar_loss(model, batch)
        changed = targets.clone()
        changed[(answer == 0) & (document == 0)] = 7  # padding targets
        same, _ = ar_loss(model, (inputs, changed, answer, document))
    assert float(same) == pytest.approx(float(loss), rel=1e-6)
    assert float(loss) == pytest.approx(parts["answer_loss"] + 0.5 * parts["document_loss"], rel=1e-5)


def test_diffusion_batch_masks_only_the_answer_window(codec):
    docs = documents("test", 3)
    window = 120
    noisy, total, prompt_lengths, targets, masked, p_mask, *_ = diffusion_batch(
        docs, codec, window, torch.Generator().manual_seed(1))
    assert targets.shape == masked.shape == (3, window)
    assert noisy.shape == (3, int(total.max()))
    assert masked.any()
    for row, doc in enumerate(docs):
        prompt = codec.encode(extraction_prompt(doc.kind, doc.text))
        answer = [*codec.encode(doc.answer_json())[: window - 1], codec.end_id]
        expected = answer + [codec.end_id] * (window - len(answer))
        p = len(prompt)
        assert int(prompt_lengths[row]) == p and int(total[row]) == p + window
        assert targets[row].tolist() == expected
        assert noisy[row, :p].tolist() == prompt
        assert noisy[row, p + window:].eq(codec.end_id).all()
        in_window = noisy[row, p: p + window]
        assert torch.equal(in_window == codec.mask_id, masked[row])
        assert torch.equal(in_window[~masked[row]], targets[row, ~masked[row]])
        assert (noisy[row] == codec.mask_id).sum() == masked[row].sum()  # nothing outside the window
    assert ((p_mask > 0) & (p_mask <= 1)).all()
    # The window is truncated answer + end when the answer is longer than it.
    long_answer = max(docs, key=lambda d: len(codec.encode(d.answer_json())))
    short = diffusion_batch([long_answer], codec, 16, torch.Generator().manual_seed(1))[3]
    assert short[0].tolist() == [*codec.encode(long_answer.answer_json())[:15], codec.end_id]


def test_diffusion_mask_rate_follows_t(codec):
    docs = documents("test", 1) * 8
    _, _, _, _, masked, p_mask, *_ = diffusion_batch(docs, codec, 400, torch.Generator().manual_seed(2))
    assert (masked.float().mean(1) - p_mask).abs().max() < 0.12
    assert float(p_mask.max() - p_mask.min()) > 0.3  # one t per row, not one per batch


def test_diffusion_loss_reads_shifted_logits():
    """With Dream's shift the answer position p is predicted from the logits at p - 1."""
    logits = torch.arange(2 * 10, dtype=torch.float).view(1, 10, 2).expand(2, -1, -1)
    starts = torch.tensor([4, 6])
    plain = window_logits(logits, starts, 3, shift=False)
    shifted = window_logits(logits, starts, 3, shift=True)
    assert plain[:, :, 0].tolist() == [[8.0, 10.0, 12.0], [12.0, 14.0, 16.0]]
    assert shifted[:, :, 0].tolist() == [[6.0, 8.0, 10.0], [10.0, 12.0, 14.0]]


def test_learning_rate_schedule():
    settings = TrainSettings(kind="ar", steps=1000, learning_rate=1e-3, warmup_steps=100, decay_fraction=0.2)
    rates = [learning_rate_at(step, settings) for step in range(settings.steps + 1)]
    peak = settings.learning_rate
    warmup, stable, decay = rates[:100], rates[100:800], rates[800:]
    assert warmup[0] == pytest.approx(peak / 100)
    assert all(a < b for a, b in pairwise(warmup))
    assert warmup[-1] == pytest.approx(peak)
    assert all(rate == peak for rate in stable)
    assert all(a >= b for a, b in pairwise(decay))
    assert decay[0] == pytest.approx(peak)
    assert rates[900] == pytest.approx(0.55 * peak)  # cosine midpoint between 100% and 10%
    assert rates[-1] == pytest.approx(0.1 * peak)
    assert rates[settings.steps - 1] == pytest.approx(0.1 * peak, rel=1e-3)  # the last step trained
    assert min(rates[100:]) >= 0.1 * peak - 1e-12


def test_curriculum_clean_phase_then_ramp():
    settings = TrainSettings(kind="ar", batch_size=4, clean_steps=5, curriculum_steps=10)
    variety = curriculum(settings)  # of the data index: 20 clean documents, then a ramp over 40
    assert [variety(i) for i in (0, 10, 19, 20)] == [0.0, 0.0, 0.0, 0.0]
    assert variety(40) == pytest.approx(0.5)
    assert all(a <= b for a, b in pairwise(variety(i) for i in range(0, 80)))
    assert variety(60) == 1.0 and variety(10_000) == 1.0
    no_clean = curriculum(TrainSettings(kind="ar", batch_size=4, clean_steps=0, curriculum_steps=10))
    assert no_clean(0) == 0.0 and no_clean(20) == pytest.approx(0.5)
    no_ramp = curriculum(TrainSettings(kind="diffusion", clean_steps=0, curriculum_steps=0))
    assert no_ramp(1) == 1.0 and no_ramp(500) == 1.0
