"""The training run itself: the prompt-isolation pattern, parallel batch building, time budgets."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import islice

import torch

from nowait import paths
from nowait.engines.diffusion.cache import forward_spans, prefill
from nowait.extraction.corpus import training_range, training_stream
from nowait.tokenizer import TextCodec
from nowait.training import (
    BUCKETS,
    BatchMaker,
    TrainSettings,
    batch_stream,
    diffusion_batch,
    planned_steps,
    prompt_isolation_mask,
    train,
)

TINY = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_prompt_isolation_mask_hides_the_answer_from_isolated_prompts_only():
    mask = prompt_isolation_mask(torch.tensor([2, 2]), torch.tensor([4, 3]), 4, torch.tensor([True, False]))
    isolated, plain = mask[0].int().tolist(), mask[1].int().tolist()
    assert isolated == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert plain == [[1, 1, 1, 0]] * 4  # only the padding key (position 3) hidden


def test_an_isolated_row_is_exactly_what_the_prompt_cache_computes(make_model):
    """Training's isolated rows and the engine's prompt cache are one attention pattern, so the
    window logits agree; the plain bidirectional forward differs (the cache approximates it)."""
    model = make_model(causal=False)
    prompt, window = torch.randint(0, 60, (7,)), torch.randint(0, 60, (5,))
    full = torch.cat([prompt, window])[None]
    isolated = model(full, attention_mask=prompt_isolation_mask(torch.tensor([7]), torch.tensor([12]), 12,
                                                                 torch.tensor([True])))[:, 7:]
    cache = prefill(model, [prompt], capacity=12, pad_id=0)
    cached = forward_spans(model, [window], [7], pad_id=0, cache=cache)
    torch.testing.assert_close(cached, isolated, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(full)[:, 7:], isolated, atol=1e-3)


def test_diffusion_batch_isolates_the_requested_share_of_rows(codec):
    docs = list(islice(training_stream(0, exclude=frozenset()), 6))
    generator = torch.Generator().manual_seed(0)
    assert diffusion_batch(docs, codec, 48, generator, prompt_isolation=1.0).prompt_isolated.all()
    assert not diffusion_batch(docs, codec, 48, generator, prompt_isolation=0.0).prompt_isolated.any()


def test_training_range_is_the_stream_cut_at_indices():
    exclude = frozenset({next(training_stream(3, exclude=frozenset())).text})  # drop document 3
    docs = training_range(0, 8, exclude=exclude)
    assert [d.doc_id for d in docs] == [f"train-{i}" for i in (0, 1, 2, 4, 5, 6, 7)]
    assert docs == list(islice(training_stream(0, exclude=exclude), 7))


def test_batches_are_a_function_of_the_pool_start_in_any_process():
    settings = TrainSettings(kind="diffusion", batch_size=3, prompt_isolation=0.5, clean_steps=0, curriculum_steps=0)
    tokenizer = paths.tokenizer_path()
    maker = BatchMaker(settings, tokenizer)
    assert all(torch.equal(a, b) for one, two in zip(maker(24), maker(24), strict=True)
               for a, b in zip(one, two, strict=True))
    here = list(islice(batch_stream(settings, tokenizer, 12), 2 * BUCKETS))
    stream = batch_stream(replace(settings, data_workers=2), tokenizer, 12)
    try:
        workers = list(islice(stream, 2 * BUCKETS))
    finally:  # close the worker pool now, as training does, not whenever the collector gets to it
        stream.close()
    assert [index for _, index in here] == [24] * BUCKETS + [36] * BUCKETS  # resume at the pool's end
    for (one, index_one), (two, index_two) in zip(here, workers, strict=True):
        assert index_one == index_two
        assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_planned_steps_spends_the_remaining_time_at_the_measured_rate():
    assert planned_steps(100, steps_per_s=5.0, remaining_s=60.0) == 100 + 1 + 300
    assert planned_steps(100, steps_per_s=5.0, remaining_s=-3.0) == 101  # out of time: end next step


def test_a_time_budgeted_run_ends_and_exports(tmp_path):
    settings = TrainSettings(kind="ar", steps=10**9, batch_size=2, minutes=0.05, eval_every=10**6,
                             eval_documents=1, threads=1, clean_steps=0, curriculum_steps=0, model=dict(TINY))
    result = train(settings, tmp_path / "run", tmp_path / "out", paths.tokenizer_path())
    assert 0 < result["step"] < 10**6
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == result["step"] and "eval" in records[-1]
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert TextCodec.from_file(tmp_path / "out" / "tokenizer.json").vocab_size > 0
