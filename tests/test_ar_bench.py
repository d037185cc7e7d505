"""The AR eval helper, the `spec` / `ar-structured` bench entries and `bench batching`, on a tiny model."""

from __future__ import annotations

import pytest

from nowait import paths
from nowait.bench.ar_entries import ar_structured_entry, spec_entry
from nowait.bench.batching import measure_batching, split_turns
from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.config import SpecEngineConfig
from nowait.engines.factory import EngineModel, engine_from
from nowait.engines.speculative import IncompatibleDraftError
from nowait.evaluation import decode_documents_with, run_engine_eval
from nowait.extraction.corpus import documents
from nowait.tokenizer import TextCodec, train_tokenizer
from tests.conftest import build_model

EVAL_FIELDS = ("field_accuracy", "doc_accuracy", "json_valid_rate", "forwards_per_doc", "tokens_per_forward",
               "latency_ms_p50", "latency_ms_p95")


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_file(paths.tokenizer_path())


@pytest.fixture(scope="module")
def model(codec):
    return build_model(0, vocab_size=codec.vocab_size, max_position=1024)


def test_decode_documents_with_keeps_order_and_matches_one_at_a_time(codec, model):
    docs = documents("test", 3)
    engine = AutoregressiveEngine(model, codec, EngineConfig(max_num_seqs=2))
    batched = decode_documents_with(engine, docs, codec, max_tokens=6)
    alone = decode_documents_with(engine, docs, codec, one_at_a_time=True, max_tokens=6)
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert [c.request_id for c in batched] == [d.doc_id for d in docs]


def test_run_engine_eval_reports_the_eval_fields(codec, model):
    engine = engine_from(SpecEngineConfig(kind="spec", method="ngram", max_num_seqs=2, structured=False),
                         EngineModel(model, codec))
    result = run_engine_eval(engine, codec, n=2, split="validation")
    assert all(field in result for field in EVAL_FIELDS)
    assert result["settings"]["engine"] == "spec" and "speculative (ngram" in result["settings"]["decoding"]


def test_spec_entry_compares_methods_with_plain_ar(codec, model):
    docs = documents("test", 2)
    entry = spec_entry(model, codec, docs, draft=build_model(1, vocab_size=codec.vocab_size, num_layers=1), gamma=3)
    assert all(field in entry for field in EVAL_FIELDS)
    assert entry["engine"] == "spec" and entry["method"] in ("ngram", "draft", "hybrid")
    assert set(entry["methods"]) == {"ngram", "draft", "hybrid"}
    assert all(m["greedy_identical_to_ar"] and m["gamma"] == 3 for m in entry["methods"].values())
    assert "latency_ms_p50" in entry["ar"] and entry["speedup_p50_vs_ar"] > 0
    assert entry["ar"]["identical_to_greedy_decode"] and entry["speedup_p50_vs_greedy_decode"] > 0
    without_draft = spec_entry(model, codec, docs[:1])  # the methods that need no draft model
    assert set(without_draft["methods"]) == {"ngram"}
    drafter = build_model(2, vocab_size=codec.vocab_size, causal=False, mask_token_id=codec.mask_id)
    drafted = spec_entry(model, codec, docs[:1], methods=("ngram", "diffusion"), drafter=drafter, drafter_codec=codec)
    assert set(drafted["methods"]) == {"ngram", "diffusion"}
    assert drafted["methods"]["diffusion"]["greedy_identical_to_ar"]
    assert drafted["methods"]["diffusion"]["draft_forwards_per_doc"] > 0  # the diffusion model drafted


def test_a_draft_with_another_tokenizer_is_refused(codec, model):
    """Same vocabulary size, other ids (a draft trained before a tokenizer change)."""
    other = TextCodec(train_tokenizer([d.text for d in documents("test", 20)], vocab_size=300))
    draft = build_model(1, vocab_size=codec.vocab_size, num_layers=1)
    with pytest.raises(IncompatibleDraftError, match="tokenizer"):
        spec_entry(model, codec, documents("test", 1), draft=draft, methods=("draft",), draft_codec=other)


def test_ar_structured_entry_measures_the_mask(codec, model):
    entry = ar_structured_entry(model, codec, documents("test", 1))
    assert all(field in entry for field in EVAL_FIELDS)
    assert entry["engine"] == "ar-structured" and entry["grammar_mask_us_per_token"] > 0


def test_measure_batching_compares_batched_and_sequential(codec, model):
    results = measure_batching(model, codec, documents("test", 3), concurrency=(1, 3), max_tokens=4)
    assert [r["concurrency"] for r in results] == [1, 3]
    for r in results:
        assert r["batched_tokens_per_s"] > 0 and r["sequential_tokens_per_s"] > 0
        assert r["outputs_identical"]
        # The phases are parts of each run's wall time; one prefill per request one at a time.
        for mode in ("batched", "sequential"):
            assert 0 < r["prefill_s"][mode] + r["decode_s"][mode] <= r[f"{mode}_s"] + 1e-3
        assert r["decode_s"]["sequential"] > 0 and r["decode_speedup"] > 0


def test_measure_batching_with_the_static_decode_step_on_reports_it_and_keeps_the_outputs(codec, model):
    """--cuda-graphs on, on this CPU: the static-shape step runs eagerly (nothing captured);
    the batch and the one-at-a-time run still agree token for token."""
    [r] = measure_batching(model, codec, documents("test", 3), concurrency=(3,), max_tokens=4, rounds=1,
                           cuda_graphs=True)
    assert r["outputs_identical"] and r["cuda_graphs"] == {"captured": False, "graphs": 0}
    [plain] = measure_batching(model, codec, documents("test", 3), concurrency=(3,), max_tokens=4, rounds=1)
    assert "cuda_graphs" not in plain


@pytest.mark.parametrize("structured", [False, True])
def test_measure_batching_runs_a_diffusion_checkpoint_through_its_own_engine(codec, structured):
    diffusion = build_model(2, vocab_size=codec.vocab_size, causal=False, mask_token_id=codec.mask_id,
                            max_position=1024)
    results = measure_batching(diffusion, codec, documents("test", 3), concurrency=(1, 3),
                               max_tokens=512 if structured else 32, structured=structured)
    assert [r["concurrency"] for r in results] == [1, 3]
    for r in results:
        assert r["batched_tokens_per_s"] > 0 and r["sequential_tokens_per_s"] > 0
        assert r["outputs_identical"]  # requests decoded together equal each one alone
        assert "decode_speedup" not in r  # the prefill/decode split is the AR engine's


def test_batched_runs_take_turns_with_parts_of_the_sequential_run(codec, model):
    results = measure_batching(model, codec, documents("test", 3), concurrency=(3,), max_tokens=4, rounds=2)
    [r] = results
    assert len(r["batched_runs_s"]) == 2 and r["outputs_identical"]
    assert min(r["batched_runs_s"]) <= r["batched_s"] <= max(r["batched_runs_s"])
    with pytest.raises(ValueError, match="rounds"):
        measure_batching(model, codec, documents("test", 1), concurrency=(1,), max_tokens=4, rounds=0)


def test_the_batching_bench_measures_prefill_without_the_prefix_cache(codec, model):
    """The batch and the one-at-a-time run send the same prompts: with a prefix cache each would
    restore the other's prompts whole."""
    from nowait.bench.batching import _engine

    engine = _engine(model, codec, [[1, 2, 3]], (1, 4), max_tokens=4, max_num_batched_tokens=64)
    assert engine.prefix_cache is None


def test_split_turns_covers_every_request_once_in_order():
    assert split_turns(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert split_turns(1, 3) == [range(0, 0), range(0, 0), range(0, 1)]
    assert [i for part in split_turns(64, 3) for i in part] == list(range(64))


def test_measure_batching_refuses_structured_ar(codec, model):
    with pytest.raises(ValueError, match="diffusion"):
        measure_batching(model, codec, documents("test", 2), concurrency=(1,), max_tokens=4, structured=True)
