"""Per-step time of two checkouts of nowait, side by side, taking turns (issue 28).

    .venv/bin/python scripts/step_overhead_ab.py --base /tmp/nowait-base/src --rounds 5 --threads 1

Starts one worker process per checkout (PYTHONPATH = its src), each loading the bundled models
once, then asks them in turn for the same measurement, `rounds` times, so a shared machine's
changing load falls on both alike. Measured: the engine's first token for a test document's
prompt (its prefill), a raw decode forward at batch 1 at context ~189 and ~0 (best of many), a
diffusion block forward (32 new tokens over a 170-token cached prompt), the AR engine's per-step
time over a whole test document and the document's time, and 64 documents with continuous
batching (output tokens/s). Each as wall time and as this thread's CPU time (one torch thread:
on a loaded machine the CPU time leaves out the waits for a core).
Prints each side's median, the speedup (how many times faster the new side is), whether the
greedy tokens are identical, and the operations one decode step and one block step dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
NEW_SRC = HERE.parent.parent / "src"
CASES = ("prefill", "decode_189", "decode_0", "diffusion_block", "engine_doc", "batch_64")
COUNTS = ("decode_ops", "diffusion_block_ops")  # counted once, not timed


def worker(threads: int, n_docs: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from nowait.checkpoints import load_pretrained
    from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
    from nowait.engines.base import GenerationRequest, SamplingParams
    from nowait.extraction.corpus import documents
    from nowait.model import KVCache
    from nowait.paths import model_dir
    from nowait.tokenizer import extraction_prompt

    ar, diffusion = load_pretrained(model_dir("ar")), load_pretrained(model_dir("diffusion"))
    codec = ar.codec
    docs = documents("test", max(n_docs, 64))
    prompts = [codec.encode(extraction_prompt(d.kind, d.text)) for d in docs]
    engine = AutoregressiveEngine(ar.model, codec, EngineConfig(max_num_seqs=64, max_model_len=600,
                                                                prefix_cache_tokens=0))

    def requests(ps: list[list[int]]) -> list:
        return [GenerationRequest(p, SamplingParams(max_tokens=160)) for p in ps]

    def best(run, budget_s: float = 1.0, repeats: int = 400) -> dict:
        """Fastest wall time and fastest CPU time of this thread (with one torch thread, the
        work itself: on a loaded machine, time spent waiting for a core is left out)."""
        run()
        wall, cpu, started = float("inf"), float("inf"), time.perf_counter()
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            run()
            wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.thread_time() - c0)
            if time.perf_counter() - started > budget_s:
                break
        return {"s": wall, "cpu_s": cpu}

    @torch.no_grad()
    def decode(context: int) -> float:
        cache = KVCache(ar.model.config, 1, context + 8)
        if context:
            ar.model(torch.randint(0, 1000, (1, context)), cache)
        filled = cache.lengths.clone()
        token = torch.tensor([[5]])

        def step() -> None:
            cache.lengths = filled.clone()
            ar.model(token, cache)
        return best(step)

    @torch.no_grad()
    def block(run=best):
        model = diffusion.model
        cache = KVCache(model.config, 1, 170 + 32)
        model(torch.randint(0, 1000, (1, 170)), cache)
        ids = torch.randint(0, 1000, (1, 32))
        positions = (170 + torch.arange(32))[None]
        outputs = torch.arange(32)[None]
        return run(lambda: model(ids, cache, write_cache=False, positions=positions, output_positions=outputs))

    def count_ops(run) -> dict:
        """Operations the dispatcher sees in one call of `run`: all of them, and those that
        compute (views and other metadata-only ones left out)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        counted: list[str] = []

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counted.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        with Count():
            run()
        views = {"view", "slice", "t", "transpose", "_unsafe_view", "unsqueeze", "select", "split", "expand",
                 "lift_fresh", "as_strided", "alias", "unflatten", "squeeze", "detach", "_reshape_alias"}
        layers = ar.model.config.num_layers
        compute = [name for name in counted if name not in views]
        return {"ops": len(counted), "compute_ops": len(compute), "ops_per_layer": round(len(counted) / layers, 1),
                "compute_ops_per_layer": round(len(compute) / layers, 1)}

    @torch.no_grad()
    def decode_ops() -> dict:
        cache = KVCache(ar.model.config, 1, 200)
        ar.model(torch.randint(0, 1000, (1, 189)), cache)
        return count_ops(lambda: ar.model(torch.tensor([[5]]), cache))

    def prefill() -> dict:
        """The first token of the first test document through the engine (its prefill and the
        first sample; no prefix cache), best of many."""
        first: list = []

        def run() -> None:
            first[:] = engine.generate([GenerationRequest(prompts[0], SamplingParams(max_tokens=1))])
        timed = best(run)
        return {**timed, "tokens": [len(prompts[0]), first[0].token_ids]}

    def engine_doc() -> dict:
        total, cpu, steps, step_cpu, tokens = 0.0, 0.0, [], [], []
        for prompt in prompts[:n_docs]:
            seq = engine.submit(requests([prompt])[0])
            started, cpu_started = time.perf_counter(), time.thread_time()
            while not seq.is_finished:
                t0, c0 = time.perf_counter(), time.thread_time()
                engine.step()
                steps.append(time.perf_counter() - t0)
                step_cpu.append(time.thread_time() - c0)
            total += time.perf_counter() - started
            cpu += time.thread_time() - cpu_started
            tokens.append(engine._completed.pop(seq.seq_id).token_ids)
        # steps[0] of each document is its prefill; the median is a decode step
        return {"s": total / n_docs, "cpu_s": cpu / n_docs, "step_s": statistics.median(steps),
                "step_cpu_s": statistics.median(step_cpu), "tokens": tokens}

    def batch_64() -> dict:
        started, cpu_started = time.perf_counter(), time.thread_time()
        done = engine.generate(requests(prompts[:64]))
        seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
        produced = sum(len(c.token_ids) for c in done)
        return {"s": seconds, "cpu_s": cpu, "tokens_per_s": produced / seconds, "tokens_per_cpu_s": produced / cpu,
                "tokens": [c.token_ids for c in done]}

    engine.generate(requests(prompts[:64]))  # warm-up: first-call allocations stay out
    for line in sys.stdin:
        case = line.strip()
        if case == "prefill":
            result: dict = prefill()
        elif case == "decode_189":
            result = decode(189)
        elif case == "decode_0":
            result = decode(0)
        elif case == "diffusion_block":
            result = block()
        elif case == "engine_doc":
            result = engine_doc()
        elif case == "batch_64":
            result = batch_64()
        elif case == "decode_ops":
            result = decode_ops()
        elif case == "diffusion_block_ops":
            result = block(count_ops)
        else:
            break
        print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="src directory of the checkout to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--docs", type=int, default=5, help="test documents per engine_doc turn")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.threads, args.docs)
        return
    sides = {}
    for name, src in (("base", args.base), ("new", str(NEW_SRC))):
        env = {**os.environ, "PYTHONPATH": src}
        sides[name] = subprocess.Popen(
            [sys.executable, str(HERE), "--worker", "--base", src, "--threads", str(args.threads),
             "--docs", str(args.docs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    cases = tuple(case for case in CASES if case in args.cases.split(","))
    results: dict[str, dict[str, list[dict]]] = {name: {case: [] for case in cases + COUNTS} for name in sides}
    for round_ in range(args.rounds):
        for case in cases + COUNTS if round_ == 0 else cases:
            for name, process in sides.items():
                process.stdin.write(case + "\n")
                process.stdin.flush()
                results[name][case].append(json.loads(process.stdout.readline()))
    for process in sides.values():
        process.stdin.write("quit\n")
        process.stdin.close()
        process.wait()
    summary = {}
    for case in COUNTS:
        summary[case] = {name: results[name][case][0] for name in sides}
    for case in cases:
        keys = [k for k in results["base"][case][0] if k != "tokens"]
        for key in keys:
            base = statistics.median(r[key] for r in results["base"][case])
            new = statistics.median(r[key] for r in results["new"][case])
            rate = key.startswith("tokens_per")
            scale, unit = (1.0, "tok/s") if rate else (1e3, "ms")
            # speedup: how many times faster the new code is (a time's base / new, a rate's new / base)
            summary[f"{case}.{key}"] = {"base": round(base * scale, 3), "new": round(new * scale, 3), "unit": unit,
                                        "speedup": round(new / base if rate else base / new, 2)}
        if "tokens" in results["base"][case][0]:
            summary[f"{case}.greedy_tokens_identical"] = all(
                a["tokens"] == b["tokens"] for a, b in zip(results["base"][case], results["new"][case], strict=True))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
