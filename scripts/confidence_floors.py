"""How many answers fall below candidate confidence floors (routing.low_confidence), per engine:
the bundled AR model through the AR engine, and the diffusion model's schema-template answers at
the fast default, on `N` documents of `SPLIT`; with how many have a wrong field.

    python scripts/confidence_floors.py validation 150
"""

from __future__ import annotations

import sys

import torch

from nowait.calibration import ar_completions, score_answers
from nowait.engines.factory import ModelCache
from nowait.evaluation import decode_records
from nowait.extraction.corpus import documents

FLOORS = (0.3, 0.5, 0.7, 0.9)


def main(split: str, n: int) -> None:
    torch.set_num_threads(1)
    models = ModelCache()
    ar, diffusion = models.load("ar"), models.load("diffusion")
    docs = documents(split, n)
    records = decode_records(diffusion.model, diffusion.codec, "diffusion", docs, 8, structured=True)
    fallback = ar_completions(ar.model, ar.codec, docs)
    answers = score_answers([r.text for r in records], [r.confidence for r in records], docs,
                            [c.text for c in fallback], [c.confidence for c in fallback])
    rows = (("diffusion", [a.confidence for a in answers], [a.wrong for a in answers]),
            ("ar", [a.fallback_confidence for a in answers],
             [a.fallback_fields_correct < a.fields_total for a in answers]))
    for name, confidences, wrong in rows:
        pairs = list(zip(confidences, wrong, strict=True))
        below = " ".join(f"below {f}: {sum(c < f for c, _ in pairs)} ({sum(c < f and w for c, w in pairs)} wrong)"
                         for f in FLOORS)
        print(f"{name}: {sum(wrong)} of {len(wrong)} wrong, least sure {min(confidences):.4f}; {below}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "validation", int(sys.argv[2]) if len(sys.argv) > 2 else 150)
