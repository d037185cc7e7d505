"""The diffusion engine's fast default at batch 1, eager and compiled (`compile`), side by side (issue 28).

    .venv/bin/python scripts/diffusion_compile_ab.py --n 50 --rounds 3

One process, one torch thread, the bundled diffusion model. Builds the engine twice (the
compiled one compiles its block step first: the time is printed), then, taking turns so that a
shared machine's changing load falls on both alike:
1. the block step alone, at the shapes a document's compiled forwards have (a dual-cache
   step, a one-position step, a refresh): this thread's CPU time per forward,
   the median of `--rounds` rounds of 30 calls each;
2. whole test documents, each decoded by both engines one after the other (the order
   alternating), `--rounds` times: per document the median CPU time and wall time, and
   whether tokens, confidences and forwards are identical.
Prints the load average before and after, each side's medians and the median over documents of
eager / compiled (how many times faster the compiled engine is).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=50, help="test documents")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from nowait.engines.config import DiffusionEngineConfig
    from nowait.engines.diffusion.cache import empty_cache, forward_spans
    from nowait.engines.factory import EngineModel, ModelCache, engine_from
    from nowait.evaluation import ANSWER_WINDOW, document_request
    from nowait.extraction.corpus import documents

    print(f"load average before: {os.getloadavg()}", flush=True)
    loaded = ModelCache().load("diffusion")
    model, target = loaded.model.eval(), EngineModel(loaded.model, loaded.codec)
    eager = engine_from(DiffusionEngineConfig(kind="diffusion", max_batch=1), target)
    compiled = engine_from(DiffusionEngineConfig(kind="diffusion", max_batch=1, compile=True), target)
    print(f"compile (warm-up): {compiled.compiled.compile_seconds:.1f} s", flush=True)

    def cpu_ms(call, calls: int = 30) -> float:
        started = time.thread_time()
        for _ in range(calls):
            call()
        return (time.thread_time() - started) / calls * 1000

    with torch.inference_mode():
        caches = empty_cache(model, 1, 448), empty_cache(model, 1, 448)
        prompt = torch.randint(2, model.config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(0))
        for cache in caches:
            model(prompt, cache)
        for name, cached, length, reads in [("dual step", 340, 31, 27), ("one-position step", 350, 2, 1),
                                             ("refresh", 313, 45, 32)]:
            span = prompt[0, :length].clone()
            outputs = torch.arange(length - reads, length)[None]

            def run_eager(cache=caches[0], cached=cached, span=span, outputs=outputs):
                cache.lengths.fill_(cached)
                return forward_spans(model, [span], [cached], 0, cache, write=True, outputs=outputs)

            def run_compiled(cache=caches[1], cached=cached, span=span, outputs=outputs):
                cache.lengths.fill_(cached)
                return compiled.compiled(span, cached, cache, outputs)

            worst = float((run_eager() - run_compiled()).abs().max())
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.rounds):
                times["eager"].append(cpu_ms(run_eager))
                times["compiled"].append(cpu_ms(run_compiled))
            e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
            print(f"{name} ({cached} cached, {length} tokens, {reads} read): eager {e:.2f} ms, compiled {c:.2f} ms, "
                  f"{e / c:.2f}x; largest logit difference {worst:.1e}", flush=True)

    requests = [document_request(doc, loaded.codec, False, max_tokens=ANSWER_WINDOW)
                for doc in documents("test", args.n)]
    for engine in (eager, compiled):
        engine.generate(requests[:2])  # first touches
    cpu: dict[str, list[float]] = {"eager": [], "compiled": []}
    wall: dict[str, list[float]] = {"eager": [], "compiled": []}
    identical = 0
    for index, request in enumerate(requests):
        samples: dict[str, tuple[list[float], list[float]]] = {"eager": ([], []), "compiled": ([], [])}
        answers = {}
        for round_ in range(args.rounds):
            order = [("eager", eager), ("compiled", compiled)]
            for name, engine in order if (index + round_) % 2 == 0 else order[::-1]:
                started_wall, started_cpu = time.perf_counter(), time.thread_time()
                [completion] = engine.generate([request])
                samples[name][0].append((time.thread_time() - started_cpu) * 1000)
                samples[name][1].append((time.perf_counter() - started_wall) * 1000)
                answers[name] = (completion.token_ids, completion.token_confidences, completion.forwards)
        for name in cpu:
            cpu[name].append(statistics.median(samples[name][0]))
            wall[name].append(statistics.median(samples[name][1]))
        (ids, confidences, forwards), (c_ids, c_confidences, c_forwards) = answers["eager"], answers["compiled"]
        identical += ids == c_ids and forwards == c_forwards and all(
            abs(a - b) < 1e-4 for a, b in zip(confidences, c_confidences, strict=True))
    print(f"documents: {len(requests)}, tokens, forwards and confidences identical on {identical}")
    for label, numbers in (("CPU", cpu), ("wall", wall)):
        ratios = [e / c for e, c in zip(numbers["eager"], numbers["compiled"], strict=True)]
        print(f"per document {label}: eager median {statistics.median(numbers['eager']):.1f} ms, compiled "
              f"{statistics.median(numbers['compiled']):.1f} ms; eager / compiled median over documents "
              f"{statistics.median(ratios):.2f}x (quartiles {statistics.quantiles(ratios, n=4)[0]:.2f}-"
              f"{statistics.quantiles(ratios, n=4)[2]:.2f})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
