"""Token lengths of a corpus tier with the bundled tokenizer: per layout the document's tokens,
and the longest prompt (instruction + document, in the wording each document carries) against
the models' context less the answer window.

    python scripts/corpus_lengths.py hard 1500
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from nowait import paths
from nowait.extraction.corpus import documents
from nowait.tokenizer import TextCodec, document_prompt

ANSWER_WINDOW = 160  # nowait.evaluation.ANSWER_WINDOW (not imported: that module loads torch)


def main(tier: str, n: int) -> None:
    codec = TextCodec.from_file(paths.tokenizer_path())
    context = json.loads((paths.model_dir("ar") / "config.json").read_text())["max_position_embeddings"]
    by_layout: dict[str, list[int]] = defaultdict(list)
    prompts, answers = [], []
    for split, seed in (("test", None), ("validation", None), (None, 1)):
        for doc in documents(split, n, seed=seed, tier=tier):
            by_layout[doc.layout].append(len(codec.encode(doc.text)))
            prompts.append(len(codec.encode(document_prompt(doc))))
            answers.append(len(codec.encode(doc.answer_json())) + 1)
    print(f"{'layout':22s} {'docs':>5s} {'mean':>6s} {'p95':>5s} {'max':>5s}  (document tokens)")
    for layout, lengths in sorted(by_layout.items()):
        lengths.sort()
        print(f"{layout:22s} {len(lengths):5d} {sum(lengths) / len(lengths):6.1f} "
              f"{lengths[int(0.95 * len(lengths))]:5d} {lengths[-1]:5d}")
    print(f"prompt tokens: mean {sum(prompts) / len(prompts):.1f}, max {max(prompts)} "
          f"(limit {context - ANSWER_WINDOW} = {context} positions - {ANSWER_WINDOW} answer window); "
          f"longest answer + end: {max(answers)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hard", int(sys.argv[2]) if len(sys.argv) > 2 else 1500)
