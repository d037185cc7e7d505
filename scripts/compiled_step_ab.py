"""The AR decode step at batch 1, eager against compiled, taking turns in one process (issue 28).

    .venv/bin/python scripts/compiled_step_ab.py --rounds 5 --contexts 0,189,400

Loads the bundled `ar` model, compiles its decode step (`nowait.model.compiled_step`, the
compile time printed), then for each round and context times the model's own forward and the
compiled step on the same one-row cache, in turn: the median and the fastest of each as this
thread's CPU time (one torch thread: on a shared machine a wait for a core is left out), their
ratio, and the largest logit difference between the two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from nowait.checkpoints import load_pretrained
from nowait.model import KVCache
from nowait.model.compiled_step import CompiledDecode
from nowait.paths import model_dir


def timed(step, repeats: int) -> list[float]:
    step()
    out = []
    for _ in range(repeats):
        started = time.thread_time()
        step()
        out.append(time.thread_time() - started)
    return out


def steps(model, compiled: CompiledDecode, context: int) -> tuple:
    """The eager forward and the compiled step, each feeding one token after the same
    `context` cached ones (the cache rolled back before each call)."""
    cache = KVCache(model.config, 1, context + 2)
    model(torch.randint(2, model.config.vocab_size, (1, max(context, 1))), cache)
    filled = cache.lengths.clone()
    token = torch.tensor([[5]])

    def eager() -> torch.Tensor:
        cache.lengths = filled.clone()
        return model(token, cache)

    def fast() -> torch.Tensor:
        cache.lengths = filled.clone()
        return compiled(5, cache)
    return eager, fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--contexts", default="0,189,400")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_pretrained(model_dir("ar")).model.eval()
    compiled = CompiledDecode(model)
    print(f"compiled in {compiled.warm_up():.1f} s")
    contexts = [int(x) for x in args.contexts.split(",")]
    samples = {(c, side): [] for c in contexts for side in ("eager", "compiled")}
    worst = 0.0
    with torch.no_grad():
        for _ in range(args.rounds):
            for context in contexts:
                eager, fast = steps(model, compiled, context)
                worst = max(worst, float((eager() - fast()).abs().max()))
                samples[context, "eager"] += timed(eager, args.repeats)
                samples[context, "compiled"] += timed(fast, args.repeats)
    print(f"load average {os.getloadavg()}; largest logit difference {worst:.2e}")
    for context in contexts:
        eager_ms, fast_ms = (statistics.median(samples[context, s]) * 1e3 for s in ("eager", "compiled"))
        best_e, best_c = (min(samples[context, s]) * 1e3 for s in ("eager", "compiled"))
        print(f"context {max(context, 1):>4}: eager {eager_ms:.3f} ms (best {best_e:.3f}), compiled {fast_ms:.3f} ms "
              f"(best {best_c:.3f}): {eager_ms / fast_ms:.2f}x")


if __name__ == "__main__":
    main()
