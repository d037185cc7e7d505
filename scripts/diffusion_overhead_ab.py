"""The diffusion engine's fast default in two checkouts of nowait, side by side, taking turns (issue 28).

    .venv/bin/python scripts/diffusion_overhead_ab.py --base /tmp/nowait-base/src --n 40 --threads 1
    .venv/bin/python scripts/diffusion_overhead_ab.py --base /tmp/nowait-base/src --n 40 --threads 1 --structured

Starts one worker process per checkout (PYTHONPATH = its src), each loading the bundled
diffusion model once; then every test document is decoded by both, one after the other, the
order alternating, so a shared machine's changing load falls on both alike. Per document: wall
time and this thread's CPU time (one torch thread: on a loaded machine the CPU time leaves out
the waits for a core). Prints each side's median, the median over documents of base / new (how
many times faster the new side is), whether the tokens are identical on every document, and the
operations a document dispatches inside the model's forward and outside it (the engine).
`--new` defaults to this checkout's src; `--new-compile` runs the new side with `compile: true`
(its compile time is printed, not counted).
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

NEW_SRC = Path(__file__).resolve().parent.parent / "src"


def worker(n: int, structured: bool, threads: int, compile_step: bool) -> None:
    import torch

    torch.set_num_threads(threads)
    from nowait.engines.config import DiffusionEngineConfig
    from nowait.engines.diffusion.request import DiffusionOptions
    from nowait.engines.factory import EngineModel, ModelCache, engine_from
    from nowait.evaluation import ANSWER_WINDOW, TEMPLATE_MAX_TOKENS, document_request
    from nowait.extraction.corpus import documents

    docs = documents("test", n)
    loaded = ModelCache().load("diffusion")
    config = DiffusionEngineConfig.with_options(DiffusionOptions(), max_batch=1)
    started = time.perf_counter()
    if compile_step:
        config = config.model_copy(update={"compile": True})
    engine = engine_from(config, EngineModel(loaded.model, loaded.codec))
    compile_s = time.perf_counter() - started
    max_tokens = TEMPLATE_MAX_TOKENS if structured else ANSWER_WINDOW
    requests = [document_request(doc, loaded.codec, structured, max_tokens=max_tokens) for doc in docs]
    engine.generate(requests[:2])  # warm: first touches, template compilation
    # A compiled graph does not run under the counting dispatch mode: its operations are not counted.
    counts = {} if compile_step else _operations(loaded.model, engine, requests[:5])
    print(json.dumps({**counts, "engine_start_s": round(compile_s, 1)}), flush=True)
    for line in sys.stdin:
        request = requests[int(line)]
        wall, cpu = time.perf_counter(), time.thread_time()
        [completion] = engine.generate([request])
        print(json.dumps({"wall_ms": (time.perf_counter() - wall) * 1000, "cpu_ms": (time.thread_time() - cpu) * 1000,
                          "ids": completion.token_ids, "forwards": completion.forwards}), flush=True)


def _operations(model, engine, requests) -> dict:
    """Operations dispatched per document, inside the model's forward and outside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts, inside = {"model": 0, "engine": 0}, [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["model" if inside[0] else "engine"] += 1
            return func(*args, **(kwargs or {}))

    forward = type(model).forward

    def counted(self, *args, **kwargs):
        inside[0] = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            inside[0] = False

    type(model).forward = counted
    try:
        with Count():
            for request in requests:
                engine.generate([request])
    finally:
        type(model).forward = forward
    return {f"{key}_ops_per_doc": round(value / len(requests), 1) for key, value in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="src directory of the checkout to compare against")
    parser.add_argument("--new", default=str(NEW_SRC), help="src directory of the new checkout")
    parser.add_argument("--n", type=int, default=40, help="test documents")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--structured", action="store_true", help="fill each kind's schema template")
    parser.add_argument("--new-compile", action="store_true", help="the new side with compile: true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.n, args.structured, args.threads, args.new_compile)
        return
    command = [sys.executable, __file__, "--worker", "--base", "-", "--n", str(args.n), "--threads", str(args.threads)]
    command += ["--structured"] if args.structured else []
    sides = {}
    for name, src in (("base", args.base), ("new", args.new)):
        side_command = command + (["--new-compile"] if name == "new" and args.new_compile else [])
        process = subprocess.Popen(side_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": src})
        sides[name] = (process, json.loads(process.stdout.readline()))
    results: dict[str, list[dict]] = {"base": [], "new": []}
    for index in range(args.n):
        for name in (("base", "new") if index % 2 == 0 else ("new", "base")):
            process = sides[name][0]
            process.stdin.write(f"{index}\n")
            process.stdin.flush()
            results[name].append(json.loads(process.stdout.readline()))
    for process, _ in sides.values():
        process.stdin.close()
        process.wait()
    pairs = list(zip(results["base"], results["new"], strict=True))
    report = {"n": args.n, "structured": args.structured, "threads": args.threads, "new_compile": args.new_compile,
              "identical_docs": sum(b["ids"] == m["ids"] for b, m in pairs),
              "forwards_per_doc": {name: statistics.fmean(r["forwards"] for r in rows)
                                   for name, rows in results.items()}}
    for clock in ("wall_ms", "cpu_ms"):
        report[clock] = {name: round(statistics.median(r[clock] for r in rows), 2) for name, rows in results.items()}
        report[clock]["speedup_median_per_doc"] = round(statistics.median(b[clock] / m[clock] for b, m in pairs), 3)
    report["operations"] = {name: counts for name, (_, counts) in sides.items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
