"""The diffusion engine on tiny random models: reference equality, cache exactness, early stop,
batching, streaming, the Completion record and bad requests."""

from __future__ import annotations

import json

import pytest
import torch

from nowait.engines.base import Engine, GenerationRequest, InvalidRequestError, SamplingParams
from nowait.engines.diffusion.cache import forward_spans, prefill
from nowait.engines.diffusion.engine import DiffusionEngine
from nowait.engines.diffusion.reference import reference_decode
from nowait.engines.diffusion.request import DiffusionOptions
from nowait.engines.diffusion.row import RowState
from nowait.model import block_causal_mask

from .conftest import build_model


class Wrapped:
    """A Transformer seen through a hook: records each call and may bias the logits.

    `end_from`: the end token becomes certain at every position >= end_from (absolute) and
    impossible before it; None leaves the end token alone. `block_causal`: uncached forwards
    attend under block_causal_mask(prefix) (the attention pattern the prompt cache is exact for).
    """

    def __init__(self, model, end_id: int, end_from: int | None = None, block_causal: int | None = None,
                 no_end: bool = False, end_bias: float = 0.0) -> None:
        self.model, self.config = model, model.config
        self.end_id, self.end_from, self.block_causal, self.no_end = end_id, end_from, block_causal, no_end
        self.end_bias = end_bias
        self.calls: list[dict] = []

    def output_weight(self):
        return self.model.output_weight()

    def eval(self):
        return self

    def __call__(self, ids, cache=None, valid_lengths=None, write_cache=True, attention_mask=None, positions=None,
                 output_positions=None, isolated_prefix=0, positions_end=None):
        if cache is None and self.block_causal is not None:
            attention_mask = block_causal_mask(self.block_causal, ids.shape[1])[None].expand(ids.shape[0], -1, -1)
        seen = positions
        if seen is None:
            start = cache.lengths[:, None] if cache is not None else torch.zeros(ids.shape[0], 1, dtype=torch.long)
            seen = start + torch.arange(ids.shape[1])
        valid = valid_lengths if valid_lengths is not None else torch.full((ids.shape[0],), ids.shape[1])
        self.calls.append({"positions": seen.clone(), "write": cache is not None and write_cache,
                           "cached": cache is not None, "valid": valid.clone(), "isolated_prefix": isolated_prefix})
        logits = self.model(ids, cache, valid_lengths=valid_lengths, write_cache=write_cache,
                            attention_mask=attention_mask, positions=positions, isolated_prefix=isolated_prefix,
                            positions_end=positions_end).clone()
        if self.no_end:
            logits[..., self.end_id] -= 30
        logits[..., self.end_id] += self.end_bias
        if self.end_from is not None:
            predicted = seen + int(self.config.logits_shift)
            logits[..., self.end_id] += torch.where(predicted >= self.end_from, 60.0, -60.0)
        if output_positions is not None:
            logits = logits.gather(1, output_positions[..., None].expand(-1, -1, logits.shape[-1]))
        return logits


def diffusion_model(codec, shift: bool = True, seed: int = 0):
    return build_model(seed, vocab_size=codec.vocab_size, causal=False, logits_shift=shift,
                       mask_token_id=codec.mask_id)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (n,), generator=generator).tolist() for n in lengths]


def request(prompt, max_tokens=12, temperature=0.0, seed=None, **options) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
                             options=options)


def test_engine_implements_the_protocol(codec):
    engine = DiffusionEngine(diffusion_model(codec), codec)
    assert isinstance(engine, Engine) and engine.kind == "diffusion"
    with pytest.raises(ValueError, match="causal"):
        DiffusionEngine(build_model(vocab_size=codec.vocab_size), codec)


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("end_bias", [0.0, 2.5, 3.0])
def test_fixed_policy_without_cache_equals_the_reference_decoder(codec, shift, end_bias):
    """One position per forward, no cache: LLaDA's reference schedule, token for token (with
    the end token made likely too, so that answers stop early in both decoders)."""
    model = Wrapped(diffusion_model(codec, shift), codec.end_id, end_bias=end_bias)
    prompts = prompts_of([5, 9, 3])
    expected = reference_decode(model, prompts, 12, 4, codec.mask_id, codec.end_id)
    engine = DiffusionEngine(model, codec, DiffusionOptions(policy="fixed", block=4, cache="none"))
    completions = engine.generate([request(p) for p in prompts])
    assert [c.token_ids for c in completions] == expected


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_prompt_cache_equals_no_cache_under_block_causal_attention(codec, shift, policy):
    """Prefilling the prompt once is exact for the attention pattern in which the prompt (all
    but its last token when logits are shifted) attends only to itself."""
    model = diffusion_model(codec, shift, seed=1)
    for prompt in prompts_of([6, 11], seed=1):
        reference = Wrapped(model, codec.end_id, block_causal=len(prompt) - int(shift))
        options = {"policy": policy, "tau": 0.02, "block": 4}
        [exact] = DiffusionEngine(reference, codec).generate([request(prompt, cache="none", **options)])
        [cached] = DiffusionEngine(model, codec).generate([request(prompt, cache="prompt", **options)])
        assert cached.token_ids == exact.token_ids
        assert cached.token_confidences == pytest.approx(exact.token_confidences, abs=1e-5)


@pytest.mark.parametrize("shift", [False, True])
def test_block_caches_equal_the_prompt_cache_when_each_block_takes_one_step(codec, shift):
    """A whole-window refresh is the prompt-cache forward, so when every block is decided by it
    the prefix and dual caches are exact (refresh="blocks" reads a suffix from the first
    refresh instead: an approximation, measured in docs/engines-diffusion.md)."""
    model = diffusion_model(codec, shift, seed=2)
    prompts = prompts_of([4, 8], seed=2)
    outputs = {}
    for mode in ("prompt", "prefix", "dual"):
        engine = DiffusionEngine(model, codec, DiffusionOptions(tau=1e-9, block=4, cache=mode, refresh="window"))
        outputs[mode] = engine.generate([request(p, max_tokens=12) for p in prompts])
    for mode in ("prefix", "dual"):
        assert [c.token_ids for c in outputs[mode]] == [c.token_ids for c in outputs["prompt"]]


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_a_block_step_reuses_the_refreshed_cache_exactly(codec, shift, mode):
    """Right after a refresh, a step over the same tokens reads the cached prefix (and suffix)
    and must give the refresh's own logits for the block: positions, slots and the cut agree."""
    model = diffusion_model(codec, shift, seed=3)
    engine = DiffusionEngine(model, codec, DiffusionOptions(block=4, cache=mode, refresh="window"))
    rows = [RowState(engine.plan(request(p, max_tokens=12)), i, shift, codec.mask_id, torch.device("cpu"))
            for i, p in enumerate(prompts_of([5, 9], seed=3))]
    for block_index in (0, 1, 2):
        for row in rows:
            row.block_index = block_index
            lo, _ = row.block
            row.window[:lo] = torch.arange(10, 10 + lo)  # earlier blocks committed
        capacity = 64
        with torch.no_grad():
            cache = prefill(model, [r.tokens[: r.prompt_prefix] for r in rows], capacity, codec.end_id)
            spans = [r.refresh_span() for r in rows]
            refresh = forward_spans(model, [s for s, _ in spans], [s for _, s in spans], codec.end_id, cache, True)
            for i, row in enumerate(rows):
                row.keep_block_cache(cache, i, mode)
            steps = [r.step_span(mode) for r in rows]
            step = forward_spans(model, [s for s, _ in steps], [s for _, s in steps], codec.end_id, cache, False)
            # The refresh itself equals a plain forward in which the cached prompt sees only itself.
            for i, row in enumerate(rows):
                mask = block_causal_mask(row.prompt_prefix, row.total_length)[None]
                full = model(row.tokens[None], attention_mask=mask)[0]
                assert torch.allclose(row.block_logits(full, 0), row.block_logits(refresh[i], spans[i][1]), atol=1e-4)
                assert torch.allclose(row.block_logits(step[i], steps[i][1]),
                                      row.block_logits(refresh[i], spans[i][1]), atol=1e-4)


@pytest.mark.parametrize("shift", [False, True])
def test_a_blocks_refresh_keeps_a_consistent_cache(codec, shift):
    """refresh="blocks": at each block after the first, one forward recomputes the block just
    finished and the new one over [prompt, earlier window, suffix]; the slots are then
    rearranged for the block's steps. A step over the same tokens right after must see exactly
    the keys the refresh saw, so it reproduces the refresh's logits for the block."""
    model = diffusion_model(codec, shift, seed=7)
    engine = DiffusionEngine(model, codec, DiffusionOptions(block=4, cache="dual", refresh="blocks"))
    rows = [RowState(engine.plan(request(p, max_tokens=14)), i, shift, codec.mask_id, torch.device("cpu"))
            for i, p in enumerate(prompts_of([5, 9], seed=7))]
    with torch.no_grad():
        cache = prefill(model, [r.tokens[: r.prompt_prefix] for r in rows], 64, codec.end_id)
        for block_index in range(len(rows[0].plan.blocks)):  # the last block is 2 wide
            spans = []
            for i, row in enumerate(rows):
                row.block_index = block_index
                lo, _ = row.block
                row.window[:lo] = torch.arange(10, 10 + lo)  # earlier blocks committed
                assert row.refreshes_blocks_only == (block_index > 0)
                spans.append(row.prepare_refresh(cache, i))
            written = cache.lengths.clone()
            refresh = forward_spans(model, [s for s, _ in spans], [s for _, s in spans], codec.end_id, cache, True)
            for i, row in enumerate(rows):
                lo, hi = row.block
                previous_lo = row.plan.blocks[block_index - 1][0] if block_index else 0
                # The span: the window from the previous block on (the whole window at first)...
                assert spans[i][1] == row.prompt_length + previous_lo - row.shift if block_index else row.prompt_prefix
                # ...over the prompt, the window before it, and the suffix after the new block.
                kept = spans[i][1] + (row.window_length - hi if block_index else 0)
                assert int(written[i]) == kept
                row.keep_block_cache(cache, i, "dual")
                # The block's steps read everything but the block (and the token before it).
                assert int(cache.lengths[i]) == row.total_length - (hi - lo) - row.shift
            steps = [r.step_span("dual") for r in rows]
            step = forward_spans(model, [s for s, _ in steps], [s for _, s in steps], codec.end_id, cache, False)
            for i, row in enumerate(rows):
                assert torch.allclose(row.block_logits(step[i], steps[i][1]),
                                      row.block_logits(refresh[i], spans[i][1]), atol=1e-4)


@pytest.mark.parametrize("shift", [False, True])
def test_a_dual_step_keeps_the_settled_positions_it_computed(codec, shift):
    """cache_decoded: after a step, the keys/values the step computed for the block positions
    that were already settled (committed before it) and lie outside the next open range stay
    in the row's cache, in slots after the prefix and suffix; the next step forwards only the
    open range: from the first position still masked or committed just now to the last."""
    model = diffusion_model(codec, shift, seed=9)
    engine = DiffusionEngine(model, codec, DiffusionOptions(block=8, cache="dual", tau=0.5))
    row = RowState(engine.plan(request(prompts_of([6], seed=9)[0], max_tokens=16)), 0, shift, codec.mask_id,
                   torch.device("cpu"))
    with torch.no_grad():
        cache = prefill(model, [row.tokens[: row.prompt_prefix]], 64, codec.end_id)
        span, start = row.prepare_refresh(cache, 0)
        forward_spans(model, [span], [start], codec.end_id, cache, True)
        row.window[[0, 1, 2, 5]] = torch.tensor([20, 21, 22, 23])  # as if the refresh had committed these
        row.keep_block_cache(cache, 0, "dual")
        base = int(cache.lengths[0])
        assert row.open_range == (0, 8) and base == row.total_length - 8 - row.shift
        for committed_now, expect_open in ((torch.tensor([3]), (3, 8)), (torch.tensor([6]), (4, 8))):
            lo, hi = row.open_range
            span, start = row.step_span("dual")
            assert (start, len(span)) == (row.prompt_length + lo - row.shift, hi - lo + row.shift)
            written_at = int(cache.lengths[0])
            forward_spans(model, [span], [start], codec.end_id, cache, True)
            written = [store[0, :, written_at: written_at + len(span)].clone() for store in cache.keys]
            cache.lengths[0] = written_at
            row.window[committed_now] = 30 + committed_now  # this step's commits
            row.keep_step_cache(cache, 0, written_at, committed_now)
            assert row.open_range == expect_open
            next_lo, next_hi = expect_open
            # Span slot j holds window offset lo - shift + j: keep [lo, next_lo) and [next_hi, hi).
            kept = [j for j in range(len(span)) if not next_lo - row.shift <= lo - row.shift + j < next_hi]
            assert int(cache.lengths[0]) == written_at + len(kept)
            for layer, store in enumerate(cache.keys):
                assert torch.equal(store[0, :, written_at: written_at + len(kept)], written[layer][:, kept])
            # Over both steps: every block offset (and the token before the block) outside the open range.
            outside = [i for i in range(-row.shift, 8) if not next_lo - row.shift <= i < next_hi]
            assert int(cache.lengths[0]) - base == len(outside)
        # The block completes; the next block's refresh (refresh="blocks") keeps the positions
        # cached before the last open range and recomputes from there: after it, the cache holds
        # every position but the new block (and the token before it), each once, and a step over
        # the same tokens sees exactly what the refresh saw.
        row.window[:8] = torch.arange(40, 48)
        row.block_index = 1
        span, start = row.prepare_refresh(cache, 0)
        assert start == row.prompt_length + 4 - row.shift  # the last open range began at offset 4
        refresh = forward_spans(model, [span], [start], codec.end_id, cache, True)
        row.keep_block_cache(cache, 0, "dual")
        assert int(cache.lengths[0]) == row.total_length - 8 - row.shift
        span, start = row.step_span("dual")
        step = forward_spans(model, [span], [start], codec.end_id, cache, False)
        assert torch.allclose(row.block_logits(step[0], start), row.block_logits(refresh[0], row._span_start),
                              atol=1e-4)


@pytest.mark.parametrize("shift", [False, True])
def test_a_blocks_refresh_equals_a_window_refresh_without_a_suffix(codec, shift):
    """With two blocks, the second block's refresh recomputes the same span either way (the
    whole window, no suffix after it): the two refresh modes decode the same tokens (without
    cache_decoded, which lets a blocks refresh reuse what the finished block's steps cached)."""
    model = diffusion_model(codec, shift, seed=8)
    prompts = prompts_of([4, 10], seed=8)
    outputs = {}
    for refresh in ("window", "blocks"):
        engine = DiffusionEngine(model, codec, DiffusionOptions(tau=0.3, block=5, cache="dual", refresh=refresh,
                                                                cache_decoded=False))
        outputs[refresh] = engine.generate([request(p, max_tokens=10) for p in prompts])
    assert [c.token_ids for c in outputs["blocks"]] == [c.token_ids for c in outputs["window"]]
    assert [c.forwards for c in outputs["blocks"]] == [c.forwards for c in outputs["window"]]


@pytest.mark.parametrize("mode", ["none", "prompt", "prefix", "dual"])
def test_early_stop_never_computes_past_the_end(codec, mode):
    """The end token is certain from window position 6 on: block 1 (positions 4-7) holds it,
    so blocks 2 and 3 are never decoded and no forward ever decodes past block 1."""
    prompt = prompts_of([7], seed=4)[0]
    end_at = len(prompt) + 6
    model = Wrapped(diffusion_model(codec), codec.end_id, end_from=end_at)
    engine = DiffusionEngine(model, codec, DiffusionOptions(block=4, cache=mode))
    [completion] = engine.generate([request(prompt, max_tokens=16)])
    assert len(completion.token_ids) == 6 and completion.finish_reason == "stop"
    assert completion.forwards == len(model.calls)
    window_start = len(prompt)
    if mode in ("prefix", "dual"):  # a lone request: prompt and the window's first refresh are one forward
        assert model.calls[0]["isolated_prefix"] == len(prompt) - 1 and model.calls[0]["write"]
    if mode == "dual":  # after the first forward, forwards end in block 1
        later = model.calls[1:]
        assert later and all(int(c["positions"][0, c["valid"][0] - 1]) < window_start + 8 for c in later)
    if mode == "prefix":
        refreshes = [c for c in model.calls if c["write"] and int(c["positions"][0, -1]) >= window_start]
        assert len(refreshes) == 2  # blocks 0 and 1 only
    # Every forward that decided something was for blocks 0 or 1: at most 8 positions to fill,
    # the end token's block committed in one go after its earlier positions.
    assert completion.forwards <= 1 + 8


def test_batched_run_equals_the_same_requests_run_alone(codec):
    model = diffusion_model(codec, seed=5)
    prompts = prompts_of([3, 12, 7, 5, 9], seed=5)
    requests = [
        request(prompts[0], max_tokens=4, block=4),
        request(prompts[1], max_tokens=20, policy="fixed", steps=2, block=5),
        request(prompts[2], max_tokens=12, temperature=0.8, seed=11, tau=0.05),
        request(prompts[3], max_tokens=16, policy="factor", factor=2.0, score="margin"),
        request(prompts[4], max_tokens=9, block=3, score="entropy", tau=0.3),
    ]
    for mode, refresh, cache_decoded in (("none", "window", False), ("prompt", "window", False),
                                         ("prefix", "window", False), ("dual", "window", False),
                                         ("dual", "blocks", False), ("dual", "blocks", True)):
        for r in requests:
            r.options.update(cache=mode, refresh=refresh, cache_decoded=cache_decoded)
        engine = DiffusionEngine(model, codec, max_batch=3)  # five requests: two join later
        batched = engine.generate(requests)
        alone = [engine.generate([r])[0] for r in requests]
        for together, single in zip(batched, alone, strict=True):
            assert together.token_ids == single.token_ids, mode
            # Alone, a request's prompt forwards with its window's first refresh: one forward fewer.
            assert together.forwards == single.forwards + (mode in ("prefix", "dual"))
            assert together.token_confidences == pytest.approx(single.token_confidences, abs=1e-5)
        # The short request left as soon as it was done, long before the longest one.
        assert batched[0].forwards < batched[1].forwards
        assert batched[0].timings.total_s < batched[1].timings.total_s


def test_templates_in_several_blocks_batched_equal_alone(codec):
    """Blocks of a template skip its fixed text, so a refresh span may cover a gap between two
    blocks; under the default dual cache (blocks refresh, settled tokens) a batch of schema
    requests still decodes as each request alone, and each output is valid for its schema."""
    from nowait.extraction.corpus import KINDS, schema_for
    from nowait.extraction.scorer import schema_valid

    model = diffusion_model(codec, seed=10)
    schemas = [schema_for(kind) for kind in KINDS]
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=512), schema=schema, options={"block": 8})
                for prompt, schema in zip(prompts_of([5, 11, 8], seed=10), schemas, strict=True)]
    engine = DiffusionEngine(model, codec, max_batch=2)
    batched = engine.generate(requests)
    for together, request_alone, kind in zip(batched, requests, KINDS, strict=True):
        [single] = engine.generate([request_alone])
        assert together.token_ids == single.token_ids
        assert together.forwards == single.forwards
        assert schema_valid(json.loads(together.text), kind)


def test_with_a_template_in_the_batch_rows_forward_alone_and_equal_their_runs_alone(codec):
    """While a schema request is active every forward carries one row (through a view of its
    cache row: no padding, no mask); free-form requests that join or stay after it decode as
    alone either way."""
    from nowait.extraction.corpus import schema_for

    model = diffusion_model(codec, seed=12)
    prompts = prompts_of([5, 11, 8, 6], seed=12)
    requests = [GenerationRequest(prompts[0], SamplingParams(max_tokens=512), schema=schema_for("kyc"),
                                  options={"block": 8}),
                request(prompts[1], max_tokens=24, block=8),
                request(prompts[2], max_tokens=40, block=8, temperature=0.7, seed=3),
                request(prompts[3], max_tokens=16, block=4)]
    engine = DiffusionEngine(model, codec, max_batch=3)
    widths = []
    forward = model.forward

    def recording(ids, *args, **kwargs):
        widths.append(ids.shape[0])
        return forward(ids, *args, **kwargs)

    model.forward = recording
    batched = engine.generate(requests)
    mixed = list(widths)
    model.forward = forward
    alone = [engine.generate([r])[0] for r in requests]
    for together, single in zip(batched, alone, strict=True):
        assert together.token_ids == single.token_ids and together.forwards == single.forwards
    assert set(mixed[: 2 * batched[0].forwards]) == {1}  # rows alone while the template row lives


def test_seeded_sampling_is_reproducible_and_differs_by_seed(codec):
    engine = DiffusionEngine(diffusion_model(codec, seed=6), codec)
    prompt = prompts_of([6], seed=6)[0]
    first, again, other = engine.generate([request(prompt, 16, 1.0, seed) for seed in (1, 1, 2)])
    assert first.token_ids == again.token_ids and first.token_ids != other.token_ids


def test_fixed_steps_per_block(codec):
    model = Wrapped(diffusion_model(codec, seed=7), codec.end_id, no_end=True)
    engine = DiffusionEngine(model, codec, DiffusionOptions(policy="fixed", steps=2, block=4, cache="none"))
    [completion] = engine.generate([request(prompts_of([5])[0], max_tokens=8)])
    assert completion.forwards == 4 and completion.tokens_per_forward == 2.0


def test_stream_sends_each_block_then_the_completion(codec):
    model = Wrapped(diffusion_model(codec, seed=8), codec.end_id, no_end=True)
    engine = DiffusionEngine(model, codec, DiffusionOptions(block=4))
    chunks = list(engine.stream(request(prompts_of([6], seed=8)[0], max_tokens=12)))
    assert [c.completion is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert 2 <= len(chunks) <= 3  # blocks 0 and 1, then the last block with the completion
    completion = chunks[-1].completion
    assert "".join(c.text for c in chunks) == completion.text
    assert [t for c in chunks for t in c.token_ids] == completion.token_ids
    assert completion.finish_reason == "length" and len(completion.token_ids) == 12


def test_completion_record(codec):
    prompt = prompts_of([7], seed=9)[0]
    model = Wrapped(diffusion_model(codec, seed=9), codec.end_id, end_from=len(prompt) + 5)
    [c] = DiffusionEngine(model, codec, DiffusionOptions(block=4)).generate([request(prompt, max_tokens=12)])
    assert c.engine == "diffusion" and c.prompt_tokens == 7 and len(c.token_ids) == 5
    assert c.completion_tokens == 6  # the five answer tokens and the end token the model generated
    assert c.text == codec.decode(c.token_ids) and c.finish_reason == "stop"
    assert len(c.token_confidences) == 5 and all(0 < p <= 1 for p in c.token_confidences)
    # The minimum over the answer's tokens and the end token that closes it.
    assert 0 < c.confidence <= min(c.token_confidences)
    assert c.confidence_kind == "min_token_probability"
    assert c.tokens_per_forward == pytest.approx(6 / c.forwards)
    t = c.timings
    assert 0 <= t.queued_s <= t.first_token_s <= t.total_s


@pytest.mark.parametrize(("change", "fragment"), [
    ({"options": {"block": 0}}, "block"),
    ({"options": {"block": -2}}, "block"),
    ({"options": {"tau": 0}}, "tau"),
    ({"options": {"tau": 1.5}}, "tau"),
    ({"options": {"tau": "high"}}, "tau"),
    ({"options": {"cache": "everything"}}, "cache"),
    ({"options": {"refresh": "sometimes"}}, "refresh"),
    ({"options": {"cache_decoded": "yes"}}, "cache_decoded"),
    ({"options": {"policy": "random"}}, "policy"),
    ({"options": {"steps": 0}}, "steps"),
    ({"options": {"factor": 0}}, "factor"),
    ({"options": {"temperature": 1}}, "unknown diffusion option"),
    ({"prompt_ids": []}, "prompt_ids is empty"),
    ({"prompt_ids": [5, 10_000]}, "prompt_ids"),
    ({"sampling": SamplingParams(max_tokens=0)}, "max_tokens"),
    ({"sampling": SamplingParams(max_tokens=600)}, "positions"),
    ({"schema": {"type": "object", "properties": {"a": {"type": "array"}}}}, "schema"),
    ({"schema": {"type": "object", "properties": {"a": {"type": "string"}}},
      "sampling": SamplingParams(max_tokens=3)}, "max_tokens"),
])
def test_bad_requests_are_refused_before_any_work(codec, change, fragment):
    model = Wrapped(diffusion_model(codec), codec.end_id)
    engine = DiffusionEngine(model, codec)
    bad = GenerationRequest(**{"prompt_ids": [5, 6, 7], **change})
    with pytest.raises(InvalidRequestError, match=fragment):
        engine.generate([request([5, 6]), bad])
    with pytest.raises(InvalidRequestError, match=fragment):
        engine.stream(bad)  # refused at the call, not at the first chunk
    assert model.calls == []
