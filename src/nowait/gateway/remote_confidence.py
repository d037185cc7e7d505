"""A remote fast engine's confidence, from the token logprobs its upstream returns.

A `kind: remote` engine that serves as the fast (diffusion) engine asks its upstream for the
chosen tokens' logprobs (`logprob_fields`) and reports the confidence the owned engines report:
`min_token_probability`, the probability of the answer's least sure token. The minimum, not the
mean, because one unsure token is enough to make an extraction wrong (a mean over a long answer
hides it), and because the same kind on both sides lets one router threshold (and a calibrated
one) read owned and remote diffusion answers alike. Only the chosen token's logprob is needed,
so no `top_logprobs` is asked for.

An answer without readable logprobs has no confidence: `None`, with the reason, never a number
made up (the dispatcher falls back on it, cause `confidence_unknown`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

CONFIDENCE_KIND = "min_token_probability"
# A log-softmax can round a hair above 0 for a certain token; more than this is not a logprob.
_ROUNDING = 1e-4


def logprob_fields(endpoint: Literal["chat", "completions"]) -> dict[str, Any]:
    """What the upstream request must carry to return the chosen tokens' logprobs: chat takes a
    flag; legacy completions take how many alternatives to list, and 0 still returns the chosen
    token's (OpenAI and vLLM both)."""
    return {"logprobs": True} if endpoint == "chat" else {"logprobs": 0}


def min_token_probability(logprobs: Sequence[float]) -> float:
    """exp of the smallest logprob: the probability the model gave the answer's least sure token."""
    return min(1.0, math.exp(min(logprobs)))


def chosen_logprobs(logprobs: Any) -> tuple[list[float] | None, str]:
    """The chosen tokens' logprobs in one OpenAI `logprobs` object (chat: `content`, a list of
    {token, logprob}; completions: `token_logprobs`), or None and why there are none."""
    if not isinstance(logprobs, dict):
        return None, "the upstream returned no logprobs"
    if "content" in logprobs:
        entries = logprobs.get("content")
        values = [e.get("logprob") if isinstance(e, dict) else None for e in entries] \
            if isinstance(entries, list) else None
    else:
        values = logprobs.get("token_logprobs")
    if not isinstance(values, list):
        return None, "the upstream's logprobs hold no token logprobs"
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value > _ROUNDING:
            return None, f"the upstream returned {value!r} where a token logprob belongs"
    return [float(v) for v in values], ""


class TokenLogprobs:
    """The chosen tokens' logprobs of one answer, from one response or gathered chunk by chunk
    from a stream; `confidence()` is the answer's, or None and why."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.missing = ""

    def add(self, logprobs: Any, has_text: bool = True) -> None:
        """One choice's `logprobs`; a stream chunk without text (the finish) may carry none."""
        if logprobs is None and not has_text:
            return
        values, why = chosen_logprobs(logprobs)
        if values is None:
            self.missing = self.missing or why
        else:
            self.values.extend(values)

    def confidence(self) -> tuple[float | None, str]:
        if self.missing:
            return None, self.missing
        if not self.values:
            return None, "the upstream returned no token logprobs for the answer"
        return min_token_probability(self.values), ""
