"""How users ask for an extraction: the one wording the clean tier uses and a pool of others.

The demo models were trained on one instruction per kind (`default_instruction`), so a client
asking "Extract the KYC fields as JSON." sent them a prompt they had never read. The pool holds
terse and verbose wordings, ones that name the kind and ones that do not, and ones with the
kind's JSON Schema pasted in; the hard tier and hard/mixed training draw from it.
"""

from __future__ import annotations

import json
import random

from nowait.extraction.kinds import KIND_SPECS

KIND_TITLES = {
    "kyc": "KYC onboarding form",
    "letter_of_credit": "letter of credit",
    "loan_application": "loan application",
}
# How users name each kind's fields ("the KYC fields"), beside the title above.
KIND_SHORT = {"kyc": "KYC", "letter_of_credit": "letter of credit", "loan_application": "loan application"}

# A pasted schema is ~300-330 tokens; it goes only with documents short enough that the prompt
# stays within the models' context (1024 positions less the 160-token answer window).
SCHEMA_MAX_DOCUMENT_CHARS = 720


def default_instruction(kind: str) -> str:
    """The wording the bundled models were trained on (`nowait.tokenizer.instruction_for`)."""
    return f"Extract the {KIND_TITLES[kind]} below as JSON."


def _wordings(kind: str) -> list[str]:
    title, short = KIND_TITLES[kind], KIND_SHORT[kind]
    return [
        default_instruction(kind),
        f"Extract the {short} fields as JSON.",
        f"Extract the {short} fields as JSON",
        f"{short} -> JSON",
        f"Return the {title}'s fields as one JSON object.",
        f"Please read this {title} and give me its fields in JSON.",
        "Extract the fields below as JSON.",
        "Return a JSON object with the fields of this document.",
        "JSON only, please.",
        f"Parse the following {title}. Reply with JSON and nothing else.",
        (f"You are a careful bank operations assistant. Read the {title} below and return its fields as "
         "one JSON object: dates as YYYY-MM-DD, countries and currencies as ISO codes, phone numbers as + "
         "and digits, amounts as numbers, and null for a field the document does not state."),
        (f"The text below is a scanned {title}; it may contain OCR errors, a cover letter or later "
         "corrections. Extract its fields as JSON, using the corrected values."),
    ]


def _schema_wordings(kind: str) -> list[str]:
    schema = json.dumps(KIND_SPECS[kind].schema)
    short = KIND_SHORT[kind]
    return [
        f"Extract the {short} fields as JSON matching this schema:\n{schema}",
        f"Return JSON valid against this JSON Schema.\nSchema: {schema}",
    ]


def instruction_pool(kind: str, with_schema: bool = True) -> list[str]:
    """Every wording for `kind` (the default first)."""
    return _wordings(kind) + (_schema_wordings(kind) if with_schema else [])


def draw_instruction(kind: str, rng: random.Random, document_chars: int) -> str:
    """One wording for a document of `document_chars` characters (a schema only when it fits)."""
    roll = rng.random()
    if roll < 0.25:  # the trained wording stays common: it is what `nowait eval` and the benches send
        return default_instruction(kind)
    if roll < 0.4 and document_chars <= SCHEMA_MAX_DOCUMENT_CHARS:
        return rng.choice(_schema_wordings(kind))
    return rng.choice(_wordings(kind))
