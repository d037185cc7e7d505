"""`nowait bench peers --peer llama.cpp`: nowait's AR engine beside llama.cpp at batch 1, same weights.

llama.cpp runs through llama-cpp-python on the GGUF file `nowait export-gguf` writes from the same
checkpoint. Both decode greedily from the same prompt ids (nowait's), one token per forward, and
each forward is timed from Python on both sides (llama.cpp: `eval` plus the argmax over its
logits; nowait: one `engine.step()`), so both pay their own per-call overhead and nothing else.
Each test document is decoded by both in turn (the order alternating from document to document),
so a shared machine's load falls on both alike. Measured per document: the prefill (the prompt's
forward and the first token), each decode step, and the whole document (wall and CPU time); a
one-token prompt gives the decode step at context ~0. Outputs are compared token for token, and
llama.cpp's own tokenizer is compared id for id with nowait's on every prompt and answer.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nowait.checkpoints import LoadedModel
    from nowait.extraction.corpus import Document

PEER = "llama.cpp"
NOWAIT = "nowait-ar"
NOWAIT_COMPILED = "nowait-ar-compiled"  # the engine with its compiled decode step (`--compile`)
MISSING = ("bench peers --peer llama.cpp needs llama-cpp-python, built from source by pip (10-20 minutes on "
           "2 cores): CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python==0.3.36 (docs/bench.md)")
# Decode steps at most this many tokens past the prompt count as "decode at the prompt's context".
NEAR_PROMPT = 16
SHORT_TOKENS = 32  # the context ~0 probe: a one-token prompt and this many tokens at most
SHAPES = ("prefill", "decode@prompt", "decode@0", "document")


class LlamaCppError(RuntimeError):
    """A llama.cpp peer run that cannot start (no llama-cpp-python, no GGUF file): one clear line."""


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppError(MISSING) from None
    return llama_cpp


@dataclass
class Run:
    """One greedy decode: output ids (end left out), prefill seconds, each decode step's seconds,
    the whole run's wall and CPU seconds."""

    ids: list[int]
    prefill_s: float
    step_s: list[float]
    wall_s: float
    cpu_s: float


@dataclass
class Samples:
    seconds: dict[str, list[float]] = field(default_factory=lambda: {shape: [] for shape in SHAPES})
    cpu_s: list[float] = field(default_factory=list)
    identical: bool = True


class LlamaCppDecoder:
    """Greedy decoding with llama.cpp, one `eval` per token, fed token ids."""

    def __init__(self, gguf_path: Path, n_ctx: int, threads: int) -> None:
        import numpy as np

        llama_cpp = import_llama_cpp()
        self._np = np
        self.llm = llama_cpp.Llama(str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.version = llama_cpp.__version__

    def _next(self) -> int:
        return int(self._np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).argmax())

    def tokenize(self, text: str) -> list[int]:
        # special=True: control tokens in the text (<|user|>) are matched, as nowait's codec matches them.
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def run(self, prompt: list[int], max_tokens: int, end_id: int) -> Run:
        wall, cpu = time.perf_counter(), time.process_time()
        self.llm.reset()  # the next eval drops every cached position past n_tokens = 0
        self.llm.eval(prompt)
        token = self._next()
        prefill = time.perf_counter() - wall
        ids, steps = [], []
        while token != end_id:
            ids.append(token)
            if len(ids) == max_tokens:
                break
            started = time.perf_counter()
            self.llm.eval([token])
            token = self._next()
            steps.append(time.perf_counter() - started)
        return Run(ids, prefill, steps, time.perf_counter() - wall, time.process_time() - cpu)


class NowaitDecoder:
    """nowait's AR engine at batch 1, one timed `step()` per forward."""

    def __init__(self, loaded: LoadedModel, max_model_len: int, compile: bool = False) -> None:
        from nowait.engines.config import ArEngineConfig
        from nowait.engines.factory import EngineModel, engine_from

        # As `bench peers` sizes it at batch 1: no prefix cache (llama.cpp's context is reset too).
        config = ArEngineConfig(kind="ar", max_num_seqs=1, max_num_batched_tokens=4096, max_model_len=max_model_len,
                                prefix_cache_tokens=0, structured=False, compile=compile)
        self.engine = engine_from(config, EngineModel(loaded.model, loaded.codec))
        compiled = self.engine.runner.compiled
        self.compile_seconds = compiled.compile_seconds if compiled is not None else None

    def run(self, prompt: list[int], max_tokens: int, end_id: int) -> Run:
        from nowait.engines.base import GenerationRequest, SamplingParams

        wall, cpu = time.perf_counter(), time.process_time()
        seq = self.engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens)))
        seconds = []
        while not seq.is_finished:
            started = time.perf_counter()
            self.engine.step()
            seconds.append(time.perf_counter() - started)
        wall_s, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
        completion = self.engine._completed.pop(seq.seq_id)  # what generate() returns, collected here
        ids = list(completion.token_ids)
        ids = ids[: ids.index(end_id)] if end_id in ids else ids
        return Run(ids, seconds[0], seconds[1:], wall_s, cpu_s)


def tokenizer_check(codec, peer: LlamaCppDecoder, texts: list[str]) -> dict:
    """llama.cpp's tokenizer against nowait's codec, id for id, on `texts`."""
    differing = []
    for text in texts:
        ours, theirs = codec.encode(text), peer.tokenize(text)
        if ours != theirs:
            pairs = zip(ours, theirs, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))
            differing.append({"text": text[:80], "at": at, "nowait": ours[at:at + 5], "llama.cpp": theirs[at:at + 5]})
    return {"texts": len(texts), "identical": len(texts) - len(differing), "differing": differing[:5]}


def _record(samples: Samples, run: Run, reference: Run | None, short: bool) -> None:
    if short:
        samples.seconds["decode@0"].extend(run.step_s)
    else:
        samples.seconds["prefill"].append(run.prefill_s)
        samples.seconds["decode@prompt"].extend(run.step_s[:NEAR_PROMPT])
        samples.seconds["document"].append(run.wall_s)
        samples.cpu_s.append(run.cpu_s)
    if reference is not None:
        samples.identical = samples.identical and run.ids == reference.ids


def _entries(name: str, engine: str, samples: Samples) -> list[dict]:
    out = []
    for shape in SHAPES:
        values = samples.seconds[shape]
        entry = {"name": name, "engine": engine, "shape": shape, "batch": 1,
                 "latency_ms_p50": round(statistics.median(values) * 1000, 3) if values else 0.0, "runs": len(values),
                 "identical": samples.identical}
        if shape == "document" and samples.cpu_s:
            entry["cpu_ms_p50"] = round(statistics.median(samples.cpu_s) * 1000, 3)
        out.append(entry)
    return out


def llama_cpp_ratios(entries: list[dict]) -> dict[str, float]:
    """nowait's p50 over llama.cpp's at each shape (above 1: llama.cpp is faster), "nowait/llama.cpp@shape"
    (and "nowait-compiled/llama.cpp@shape" for the compiled step's entries)."""
    theirs = {e["shape"]: e for e in entries if e["engine"] == PEER}
    out = {}
    for entry in entries:
        peer = theirs.get(entry["shape"])
        if entry["engine"] != PEER and peer is not None and peer["latency_ms_p50"] > 0:
            ratio = entry["latency_ms_p50"] / peer["latency_ms_p50"]
            out[f"{entry['engine']}/llama.cpp@{entry['shape']}"] = round(ratio, 3)
    return out


def measure_llama_cpp(loaded: LoadedModel, docs: list[Document], gguf_path: Path, threads: int,
                      max_tokens: int = 160, compile: bool = False) -> dict:
    """The llama.cpp peer report: entries per engine and shape, ratios, the tokenizer check.
    `compile`: nowait's engine with its compiled decode step runs too, in the same turns."""
    from nowait.tokenizer import document_prompt

    if not gguf_path.is_file():
        raise LlamaCppError(f"{gguf_path}: no such GGUF file (write it with: nowait export-gguf MODEL_DIR {gguf_path})")
    codec, end_id = loaded.codec, loaded.codec.end_id
    texts = [document_prompt(d) for d in docs]
    prompts = [codec.encode(t) for t in texts]
    n_ctx = min(loaded.model.config.max_position, max(len(p) for p in prompts) + max_tokens + 1)
    peer = LlamaCppDecoder(gguf_path, n_ctx, threads)
    ours = NowaitDecoder(loaded, n_ctx)
    decoders = {NOWAIT: ours, PEER: peer}
    if compile:
        decoders[NOWAIT_COMPILED] = NowaitDecoder(loaded, n_ctx, compile=True)
    samples = {name: Samples() for name in decoders}
    short = prompts[0][:1]  # the prompt's first token (<|user|>): decode steps at context ~0
    for run in decoders.values():  # warm-up: first-call allocations stay out of the numbers
        run.run(prompts[0], max_tokens, end_id)
    load_before = os.getloadavg()
    jobs = [(p, False) for p in prompts] + [(short, True)] * max(1, len(prompts) // 4)
    for index, (prompt, is_short) in enumerate(jobs):
        order = list(decoders) if index % 2 == 0 else list(reversed(decoders))
        runs = {name: decoders[name].run(prompt, SHORT_TOKENS if is_short else max_tokens, end_id) for name in order}
        for name, run in runs.items():
            _record(samples[name], run, None if name == NOWAIT else runs[NOWAIT], is_short)
    entries = _entries(NOWAIT, "nowait", samples[NOWAIT]) + _entries(PEER, PEER, samples[PEER])
    if compile:
        entries += _entries(NOWAIT_COMPILED, "nowait-compiled", samples[NOWAIT_COMPILED])
    answers = [d.answer_json() for d in docs]
    return {"peers": entries, "ratios": llama_cpp_ratios(entries),
            "tokenizer": tokenizer_check(codec, peer, texts + answers),
            "prompt_tokens_p50": statistics.median(len(p) for p in prompts),
            "load_average": {"before": [round(x, 2) for x in load_before],
                             "after": [round(x, 2) for x in os.getloadavg()]},
            "llama_cpp_python": peer.version,
            "compile_seconds": decoders[NOWAIT_COMPILED].compile_seconds if compile else None}


def print_llama_cpp(report: dict, echo) -> None:
    """The text report, one line per engine and shape, then the ratios and the tokenizer check."""
    for e in report["peers"]:
        cpu = f"  cpu p50 {e['cpu_ms_p50']:>8.1f} ms" if "cpu_ms_p50" in e else ""
        echo(f"{e['shape']:<14} {e['name']:<18} p50 {e['latency_ms_p50']:>9.3f} ms  runs {e['runs']:>5}{cpu}  "
             f"identical to nowait: {e['identical']}")
    for key, value in report["ratios"].items():
        echo(f"{key}: {value}x")
    check = report["tokenizer"]
    echo(f"tokenizer: llama.cpp gives nowait's ids on {check['identical']} of {check['texts']} texts")
    echo(f"prompt tokens p50 {report['prompt_tokens_p50']}, load average {report['load_average']['before']} -> "
         f"{report['load_average']['after']}")
