"""Log probabilities of chosen tokens, from logits an engine already has (no extra forward).

What a logprob is, for every engine: the log-softmax of the model's logits at temperature 1,
before temperature, top-k/top-p or a grammar mask (vLLM's default, "raw" logprobs), so the number
says what the model thought, not what the sampler was allowed to draw; it is the log of the
token confidence the router already reads. Computed only for the rows of requests that ask
(`SamplingParams.logprobs` not None): other requests pay nothing.
"""

from __future__ import annotations

from torch import Tensor

from nowait.engines.base import TokenLogprob


def chosen_logprobs(logits: Tensor, tokens: Tensor, top: int) -> list[TokenLogprob]:
    """One `TokenLogprob` per row of `logits` [N, V] for `tokens` [N], with the `top` most
    likely tokens of each row (at most the vocabulary)."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0].tolist()
    k = min(top, logprobs.shape[-1])
    if k <= 0:
        return [TokenLogprob(int(t), lp) for t, lp in zip(tokens.tolist(), chosen, strict=True)]
    values, ids = logprobs.topk(k, dim=-1)
    return [TokenLogprob(int(t), lp, tuple(zip(row_ids, row_values, strict=True)))
            for t, lp, row_ids, row_values in zip(tokens.tolist(), chosen, ids.tolist(), values.tolist(), strict=True)]


def row_logprobs(logits: Tensor, tokens: Tensor, wanted: list[int | None]) -> list[TokenLogprob | None]:
    """`chosen_logprobs` for the rows whose request asked (`wanted[i]`: its top count, None: not
    asked); None for the others, which are never computed."""
    asking = [i for i, k in enumerate(wanted) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(wanted)
    if not asking:
        return out
    index = tokens.new_tensor(asking)
    entries = chosen_logprobs(logits[index.to(logits.device)], tokens[index.to(tokens.device)],
                              max(wanted[i] for i in asking))
    for i, entry in zip(asking, entries, strict=True):
        out[i] = TokenLogprob(entry.token_id, entry.logprob, entry.top[: wanted[i]])
    return out
