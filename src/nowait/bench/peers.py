"""`nowait bench peers`: nowait's AR engine beside transformers' `generate`, same weights, same documents.

The bundled AR checkpoint is a Llama checkpoint on disk, so transformers loads the very same
file with its own `LlamaForCausalLM`. At batch 1 each test document is decoded greedily by
nowait's AR engine, by `generate` with the dynamic cache and by `generate` with the static cache,
taking turns on each document so that a shared machine's changing load falls on all three
alike. At batch B (8 and 64 by default) the first B documents go to nowait's continuous batching
and to one batched (left-padded) `generate`, taking turns `rounds` times; the median run counts.
Every output is compared token for token with nowait's. transformers is the optional extra
`nowait[peers]`, imported only by this command.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from nowait.bench.app import bench_app

if TYPE_CHECKING:
    from nowait.checkpoints import LoadedModel
    from nowait.extraction.corpus import Document

PEER_ENGINE = "transformers"
LLAMA_CPP = "llama.cpp"
NOWAIT = "nowait"
MISSING = ("bench peers needs transformers, the optional extra: pip install 'nowait[peers]' "
           "(transformers==5.23.0)")


class PeersError(RuntimeError):
    """A peers run that cannot start (transformers missing): one clear line."""


@dataclass(frozen=True)
class Timing:
    """One engine's runs at one batch size: seconds per run, output tokens per run, identical to nowait's."""

    name: str
    engine: str
    batch: int
    seconds: list[float]
    tokens: list[int]
    identical: bool


def summarize(timing: Timing) -> dict:
    """The JSON entry of one engine at one batch: p50 latency of a run (one document at batch 1,
    one batch of documents otherwise) and output tokens per second over all its runs."""
    total_s = sum(timing.seconds)
    return {"name": timing.name, "engine": timing.engine, "batch": timing.batch,
            "latency_ms_p50": round(statistics.median(timing.seconds) * 1000, 3),
            "tokens_per_s": round(sum(timing.tokens) / total_s, 1) if total_s > 0 else 0.0,
            "identical": timing.identical, "runs": len(timing.seconds)}


def peer_ratios(entries: list[dict]) -> dict[str, float]:
    """Each transformers entry's p50 latency over nowait's at the same batch (how many times
    nowait is faster), keyed "peer/nowait@batch"."""
    ours = {e["batch"]: e for e in entries if e["engine"] == NOWAIT}
    out: dict[str, float] = {}
    for entry in entries:
        base = ours.get(entry["batch"])
        if entry["engine"] == NOWAIT or base is None or base["latency_ms_p50"] <= 0:
            continue
        out[f"{entry['name']}/{base['name']}@{entry['batch']}"] = round(
            entry["latency_ms_p50"] / base["latency_ms_p50"], 3)
    return out


def import_transformers():
    """transformers, or PeersError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise PeersError(MISSING) from None
    return transformers


def hf_model(loaded: LoadedModel, device: str = "cpu"):
    """transformers' own Llama on the checkpoint nowait loaded (the same file on disk)."""
    import torch

    transformers = import_transformers()
    transformers.utils.logging.disable_progress_bar()  # its loading bar would break --json's one line
    model = transformers.LlamaForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32)
    return model.to(device).eval()


def answer_ids(ids: list[int], end_id: int) -> list[int]:
    """The answer as nowait reports it: up to the first end token, which is left out."""
    return ids[: ids.index(end_id)] if end_id in ids else list(ids)


class HfGenerate:
    """Greedy `generate` of transformers with one cache implementation, prompts left-padded."""

    def __init__(self, model, end_id: int, max_tokens: int, cache: str) -> None:
        self.model, self.end_id, self.max_tokens, self.cache = model, end_id, max_tokens, cache

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        import torch

        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.end_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        options = {"cache_implementation": "static"} if self.cache == "static" else {}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      max_new_tokens=self.max_tokens, do_sample=False, eos_token_id=self.end_id,
                                      pad_token_id=self.end_id, **options)
        return [answer_ids(row.tolist(), self.end_id) for row in out[:, width:]]


def _nowait_engine(loaded: LoadedModel, batch: int, prompts: list[list[int]], max_tokens: int):
    from nowait.engines.config import ArEngineConfig
    from nowait.engines.factory import EngineModel, engine_from

    # As bench batching sizes it: rows for these requests, no prefix cache (the same prompts come
    # back every turn, and a peer has no prefix cache either).
    max_model_len = min(loaded.model.config.max_position, max(len(p) for p in prompts) + max_tokens + 1)
    config = ArEngineConfig(kind="ar", max_num_seqs=batch, max_num_batched_tokens=max(4096, batch),
                            max_model_len=max_model_len, prefix_cache_tokens=0, structured=False)
    return engine_from(config, EngineModel(loaded.model, loaded.codec))


def _timed(run, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    outputs = run(prompts)
    return outputs, time.perf_counter() - started


def measure_peers(loaded: LoadedModel, docs: list[Document], batches: tuple[int, ...] = (1, 8, 64),
                  n: int | None = None, max_tokens: int = 160, rounds: int = 3, device: str = "cpu") -> list[dict]:
    """The `peers` entries: nowait and transformers at each batch size, outputs compared. Batch 1
    decodes the first `n` documents (default: all), batch B the first B, `rounds` times."""
    from nowait.engines.base import GenerationRequest, SamplingParams
    from nowait.tokenizer import extraction_prompt

    if max(batches) > len(docs):
        raise ValueError(f"batch {max(batches)} needs at least that many documents, got {len(docs)}")
    codec, end_id = loaded.codec, loaded.codec.end_id
    prompts = [codec.encode(extraction_prompt(d.kind, d.text)) for d in docs]
    hf = hf_model(loaded, device)
    peers = {"generate-dynamic": HfGenerate(hf, end_id, max_tokens, "dynamic"),
             "generate-static": HfGenerate(hf, end_id, max_tokens, "static")}
    entries = []
    for batch in batches:
        engine = _nowait_engine(loaded, batch, prompts, max_tokens)

        def ours(group: list[list[int]], engine=engine) -> list[list[int]]:
            requests = [GenerationRequest(p, SamplingParams(max_tokens=max_tokens)) for p in group]
            return [answer_ids(c.token_ids, end_id) for c in engine.generate(requests)]

        runners = {"nowait-ar" if batch == 1 else "nowait-continuous-batching": ours}
        # Static cache at batch 1 only: a batched static cache is allocated per batch shape and
        # is what the batch-1 latency comparison asks about.
        runners.update(peers if batch == 1 else {"generate-dynamic": peers["generate-dynamic"]})
        groups = [[p] for p in prompts[:n]] if batch == 1 else [prompts[:batch]] * rounds
        for run in runners.values():  # warm-up: first-call allocations stay out of the numbers
            run(groups[0])
        seconds: dict[str, list[float]] = {name: [] for name in runners}
        tokens: dict[str, list[int]] = {name: [] for name in runners}
        identical = dict.fromkeys(runners, True)
        for group in groups:  # taking turns: every engine on this group before the next group
            reference = None
            for name, run in runners.items():
                outputs, spent = _timed(run, group)
                reference = outputs if reference is None else reference
                seconds[name].append(spent)
                tokens[name].append(sum(len(o) for o in outputs))
                identical[name] = identical[name] and outputs == reference
        for name in runners:
            engine_name = NOWAIT if name.startswith("nowait") else PEER_ENGINE
            entries.append(summarize(Timing(name, engine_name, batch, seconds[name], tokens[name], identical[name])))
    return entries


@bench_app.command("peers")
def peers(
    n: int = typer.Option(20, min=1, help="test documents at batch 1, each decoded once per engine"),
    batches: str = typer.Option("1,8,64", help="comma-separated batch sizes (1: one document at a time)"),
    model: str = typer.Option("ar", help="AR checkpoint directory or bundled model (a Llama checkpoint)"),
    max_tokens: int = typer.Option(160, min=1, help="output tokens at most per document"),
    rounds: int = typer.Option(3, min=1, help="batched runs per engine at each batch above 1 (median kept)"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice); llama.cpp gets as many"),
    peer: str = typer.Option(PEER_ENGINE, "--peer", help="transformers, or llama.cpp (batch 1, needs --gguf)"),
    gguf: Path = typer.Option(None, "--gguf", help="llama.cpp's weights: the file `nowait export-gguf` wrote"),
    compile: bool = typer.Option(False, "--compile", help="llama.cpp peer: nowait's engine with its compiled "
                                                          "decode step too (compiled first: up to a minute)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """nowait's AR engine and continuous batching vs transformers' generate (or llama.cpp) on the same weights."""
    import torch

    from nowait.checkpoints import check_device
    from nowait.cli_errors import fail
    from nowait.engines.factory import ModelCache
    from nowait.extraction.corpus import documents

    try:
        levels = tuple(int(x) for x in batches.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        fail(f"--batches must be positive integers separated by commas, got {batches!r}")
    if peer not in (PEER_ENGINE, LLAMA_CPP):
        fail(f"unknown --peer {peer!r}; choose {PEER_ENGINE} or {LLAMA_CPP}")
    if threads:
        torch.set_num_threads(threads)
    if peer == LLAMA_CPP:
        _llama_cpp_peer(model, gguf, n, max_tokens, device, as_json, compile)
        return
    try:
        import_transformers()
        check_device(device)
        loaded = ModelCache().load(model, device=device)
    except (PeersError, ValueError) as error:  # CheckpointError is a ValueError
        fail(str(error))
    if not loaded.model.config.causal:
        fail(f"bench peers compares AR decoding; {loaded.path} is a diffusion checkpoint")
    docs = documents("test", max(n, *levels))
    try:
        entries = measure_peers(loaded, docs, levels, n, max_tokens, rounds, device)
    except ValueError as error:
        fail(str(error))
    report = {"peers": entries, "ratios": peer_ratios(entries),
              "settings": {"model": str(loaded.path), "n": n, "batches": list(levels), "max_tokens": max_tokens,
                           "rounds": rounds, "device": device, "threads": torch.get_num_threads(),
                           "transformers": import_transformers().__version__}}
    if as_json:
        print(json.dumps(report))
        return
    for e in entries:
        typer.echo(f"batch {e['batch']:>3} {e['name']:<28} p50 {e['latency_ms_p50']:>10.1f} ms  "
                   f"{e['tokens_per_s']:>9.1f} tok/s  identical to nowait: {e['identical']}")
    for key, value in report["ratios"].items():
        typer.echo(f"{key}: {value}x")



def _llama_cpp_peer(model: str, gguf: Path | None, n: int, max_tokens: int, device: str, as_json: bool,
                    compile: bool = False) -> None:
    """`--peer llama.cpp` (`nowait.bench.peers_llamacpp`): batch 1 on the CPU, both at torch's thread count."""
    import torch

    from nowait.bench.peers_llamacpp import LlamaCppError, import_llama_cpp, measure_llama_cpp, print_llama_cpp
    from nowait.cli_errors import fail
    from nowait.engines.factory import ModelCache
    from nowait.extraction.corpus import documents

    if gguf is None:
        fail("--peer llama.cpp needs --gguf PATH (write it with: nowait export-gguf MODEL_DIR PATH)")
    if device != "cpu":
        fail("--peer llama.cpp runs on the CPU (llama-cpp-python as pip builds it); use --device cpu")
    try:
        import_llama_cpp()
        loaded = ModelCache().load(model, device=device)
        if not loaded.model.config.causal:
            fail(f"bench peers compares AR decoding; {loaded.path} is a diffusion checkpoint")
        threads = torch.get_num_threads()
        report = measure_llama_cpp(loaded, documents("test", n), gguf, threads, max_tokens, compile)
    except (LlamaCppError, ValueError) as error:  # CheckpointError is a ValueError
        fail(str(error))
    report["settings"] = {"model": str(loaded.path), "gguf": str(gguf), "n": n, "max_tokens": max_tokens,
                          "threads": threads, "peer": LLAMA_CPP, "compile": compile}
    if as_json:
        print(json.dumps(report))
        return
    print_llama_cpp(report, typer.echo)
