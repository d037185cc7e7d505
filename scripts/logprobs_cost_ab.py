"""What logprobs cost the AR engine: the same batch with and without them, taking turns.

    .venv/bin/python scripts/logprobs_cost_ab.py --rounds 5 --batch 8 --tokens 32

The bundled demo AR model decodes `batch` extraction prompts greedily, `tokens` each, three
ways in turn each round (so a shared machine's changing load falls on all alike): no request
asks for logprobs, one of them asks (top 5: the others must pay nothing), all ask (top 5).
Prints each way's median wall and CPU seconds (this thread's: with one torch thread, the waits
for a core on a loaded machine are left out) and their ratios to "none", and whether the tokens
are identical.
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import islice

import torch

from nowait.checkpoints import load_pretrained
from nowait.engines.ar.engine import AutoregressiveEngine
from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.extraction.corpus import documents
from nowait.paths import model_dir
from nowait.tokenizer import extraction_prompt

WAYS = ("none", "one asks", "all ask")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    loaded = load_pretrained(model_dir("ar"))
    engine = AutoregressiveEngine(loaded.model, loaded.codec, end_ids=loaded.conventions.end_ids)
    prompts = [loaded.codec.encode(extraction_prompt(d.kind, d.text))
               for d in islice(documents("validation"), args.batch)]

    def run(asking: int) -> tuple[float, float, list[list[int]]]:
        requests = [GenerationRequest(p, SamplingParams(max_tokens=args.tokens, stop_token_ids=(),
                                                        logprobs=5 if i < asking else None))
                    for i, p in enumerate(prompts)]
        started, cpu = time.perf_counter(), time.thread_time()
        completions = engine.generate(requests)
        return time.perf_counter() - started, time.thread_time() - cpu, [c.token_ids for c in completions]

    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu_seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    tokens: dict[str, list[list[int]]] = {}
    run(0)  # warm-up
    for _ in range(args.rounds):
        for way, asking in zip(WAYS, (0, 1, args.batch), strict=True):
            elapsed, cpu, tokens[way] = run(asking)
            seconds[way].append(elapsed)
            cpu_seconds[way].append(cpu)
    base, cpu_base = statistics.median(seconds["none"]), statistics.median(cpu_seconds["none"])
    for way in WAYS:
        wall, cpu = statistics.median(seconds[way]), statistics.median(cpu_seconds[way])
        print(f"{way:>9}: wall {wall * 1000:8.1f} ms ({wall / base:.3f}x none)   "
              f"cpu {cpu * 1000:8.1f} ms ({cpu / cpu_base:.3f}x none)")
    print("tokens identical:", all(tokens[way] == tokens["none"] for way in WAYS))


if __name__ == "__main__":
    main()
