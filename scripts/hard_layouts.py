"""Field accuracy of a causal (AR) checkpoint on the hard tier per layout, and over the training
layouts against the held-out ones (the issue's ">= 0.90 on held-out layouts"), greedy decoding.
`--wording document` asks each document in the wording it carries (the instruction pool);
`default` in the one trained wording, as `nowait eval` does. `--labels swapped` reads the same
documents with the other label set (held-out layouts with training labels, training layouts with
held-out labels), to tell whether an unseen layout or an unseen wording is what the model misses.

    python scripts/hard_layouts.py src/nowait/assets/ar 90 [--seed S] [--wording document|default] \
        [--labels as-drawn|swapped]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from nowait.checkpoints import load_pretrained
from nowait.engines.ar.engine import greedy_decode
from nowait.extraction.corpus import HELD_OUT_LAYOUTS, Document, documents, hard_documents_relabelled
from nowait.extraction.scorer import score_document, summarize
from nowait.tokenizer import document_prompt, extraction_prompt

ANSWER_WINDOW = 160


def prompt_of(doc: Document, wording: str) -> str:
    return document_prompt(doc) if wording == "document" else extraction_prompt(doc.kind, doc.text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("n", type=int)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--wording", choices=("document", "default"), default="default")
    parser.add_argument("--labels", choices=("as-drawn", "swapped"), default="as-drawn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_pretrained(args.model)
    model, codec = loaded.model.eval(), loaded.codec
    if args.labels == "swapped":
        docs = hard_documents_relabelled("test", args.n, seed=args.seed)
    else:
        docs = documents("test", args.n, seed=args.seed, tier="hard")
    groups: dict[str, list] = defaultdict(list)
    for start in range(0, len(docs), 16):
        chunk = docs[start: start + 16]
        prompts = [codec.encode(prompt_of(d, args.wording)) for d in chunk]
        with torch.no_grad():
            outputs = greedy_decode(model, prompts, ANSWER_WINDOW, codec.end_id)
        for ids, doc in zip(outputs, chunk, strict=True):
            score = score_document(codec.decode(ids), doc.fields, doc.kind)
            groups[doc.layout].append(score)
            groups["all held-out" if doc.layout in HELD_OUT_LAYOUTS else "all training layouts"].append(score)
            groups["all"].append(score)
    for name, scores in sorted(groups.items()):
        print(f"{name:22s} n={len(scores):4d} field_accuracy={summarize(scores)['field_accuracy']:.3f}")


if __name__ == "__main__":
    main()
