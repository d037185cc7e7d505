"""`nowait bench peers --peer llama.cpp`: the ratio arithmetic, the refusals, nowait's timed decoder
against the plain greedy decoder, the tokenizer check. llama.cpp itself is never run here (it is
built by hand, docs/bench.md; CI skips nothing): the bench compares both engines' tokens on
every document it runs and reports `identical`."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from nowait.bench.peers_llamacpp import (
    MISSING,
    LlamaCppError,
    NowaitDecoder,
    import_llama_cpp,
    llama_cpp_ratios,
    tokenizer_check,
)
from nowait.checkpoints import load_pretrained, save_pretrained
from nowait.cli import app
from nowait.engines.ar.engine import greedy_decode
from nowait.extraction.corpus import training_stream
from nowait.tokenizer import document_prompt
from tests.conftest import build_model


def entry(name: str, engine: str, shape: str, p50: float) -> dict:
    return {"name": name, "engine": engine, "shape": shape, "batch": 1, "latency_ms_p50": p50, "runs": 1,
            "identical": True}


def test_ratios_are_nowaits_time_over_llama_cpps_at_each_shape():
    entries = [entry("nowait-ar", "nowait", "prefill", 15.0), entry("nowait-ar", "nowait", "decode@0", 3.0),
               entry("nowait-ar", "nowait", "document", 200.0), entry("llama.cpp", "llama.cpp", "prefill", 10.0),
               entry("llama.cpp", "llama.cpp", "decode@0", 0.5), entry("llama.cpp", "llama.cpp", "document", 0.0)]
    assert llama_cpp_ratios(entries) == {"nowait/llama.cpp@prefill": 1.5, "nowait/llama.cpp@decode@0": 6.0}
    # `--compile`: the compiled step's entries get ratios of their own, beside the eager ones
    compiled = [entry("nowait-ar-compiled", "nowait-compiled", "decode@0", 1.0)]
    assert llama_cpp_ratios(entries + compiled) == {"nowait/llama.cpp@prefill": 1.5, "nowait/llama.cpp@decode@0": 6.0,
                                                    "nowait-compiled/llama.cpp@decode@0": 2.0}


def test_missing_llama_cpp_python_and_missing_gguf_are_one_line_each(monkeypatch, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "peers", "--peer", "llama.cpp"])
    assert result.exit_code == 2 and "--gguf PATH" in result.output
    result = runner.invoke(app, ["bench", "peers", "--peer", "vllm"])
    assert result.exit_code == 2 and "unknown --peer 'vllm'" in result.output
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it raises ImportError
    with pytest.raises(LlamaCppError, match=r"llama-cpp-python==0\.3\.36"):
        import_llama_cpp()
    result = runner.invoke(app, ["bench", "peers", "--peer", "llama.cpp", "--gguf", str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and MISSING in result.output


@pytest.fixture
def tiny(tmp_path, codec):
    save_pretrained(build_model(vocab_size=codec.vocab_size), codec, tmp_path / "tiny")
    return load_pretrained(tmp_path / "tiny")


def test_nowaits_timed_decoder_gives_the_greedy_tokens_and_one_step_per_forward(tiny):
    prompt = tiny.codec.encode(document_prompt(next(iter(training_stream(0)))))[:40]
    expected = greedy_decode(tiny.model, [prompt], 12, tiny.codec.end_id)[0]
    run = NowaitDecoder(tiny, 64).run(prompt, 12, tiny.codec.end_id)
    assert run.ids == expected and len(expected) > 0
    # The prefill gives the first token; each later token, and the end token, one decode step.
    assert len(run.step_s) == (len(expected) if len(expected) < 12 else 11)
    assert run.prefill_s > 0 and run.wall_s >= run.prefill_s + sum(run.step_s) and run.cpu_s > 0


class Splitter:
    """A peer tokenizer that splits every text differently from nowait's after its first token."""

    def __init__(self, codec) -> None:
        self.codec = codec

    def tokenize(self, text: str) -> list[int]:
        ids = self.codec.encode(text)
        return [*ids[:1], self.codec.end_id, *ids[1:]] if "x" in text else ids


def test_the_tokenizer_check_names_where_the_ids_part(codec):
    check = tokenizer_check(codec, Splitter(codec), ["a b c", "x y z", "no ex"])
    assert check["texts"] == 3 and check["identical"] == 1
    assert [d["at"] for d in check["differing"]] == [1, 1]
    assert check["differing"][0]["llama.cpp"][0] == codec.end_id
