"""Verifying proposals: which of them the target accepts, and what it expects to.

The target scores the pending token plus the proposals in one forward; proposals are accepted
left to right with probability min(1, p(x) / q(x)) (p: target, q: draft; the issue writes them
the other way round), and at the first rejection the next token is drawn from
norm(max(0, p - q)); when all are accepted a bonus token comes from the target. This leaves the
output distributed exactly as the target's; at temperature 0 both are one-hot, so greedy
output is the target's argmax token for token. A deterministic proposer (prompt lookup) is a
draft whose q is a point mass. When every row of a step is greedy and unconstrained, the
engine takes that one-hot case directly (`greedy_accept`: proposals agreeing with the target's
argmax), without building distributions: on small models the per-step tensor work is a large
part of a step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nowait.engines.ar.sampling import sample_from


# Leviathan et al. 2023, Algorithm 1 (speculative sampling), for a batch of rows with their
# own number of proposals.
def speculative_accept(draft_tokens: Tensor, num_drafts: Tensor, target_probs: Tensor,
                       draft_probs: Tensor | None, accept_uniforms: Tensor,
                       sample_uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """How many proposals each row accepts, and the token that follows them.

    draft_tokens [B, K] (rows padded past `num_drafts[b]`), target_probs [B, K + 1, V]
    (p at each proposal and after the last), draft_probs [B, K, V] (q), or None for a
    deterministic proposer (q is a point mass on the proposal), uniforms [B, K] and [B].
    Returns accepted [B] and next_token [B]: the residual norm(max(0, p - q)) at the first
    rejection, the target's own distribution after the last proposal when none is rejected.
    """
    # The proposals, counts and uniforms are made on the host; the probabilities live where the
    # models run.
    device = target_probs.device
    draft_tokens, num_drafts = draft_tokens.to(device), num_drafts.to(device)
    accept_uniforms = accept_uniforms.to(device)
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=device)
    if k == 0:
        return torch.zeros(batch, dtype=torch.long, device=device), sample_from(target_probs[:, 0], sample_uniforms)
    p_of_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).clamp(min=1e-30)
    # u < p/q accepts with probability min(1, p/q); u is in [0, 1), so p >= q always accepts.
    accept = (accept_uniforms < p_of_draft / q_of_draft) & (torch.arange(k, device=device)[None, :]
                                                             < num_drafts[:, None])
    accepted = accept.long().cumprod(-1).sum(-1)
    p_next = target_probs[rows, accepted]
    at = accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at]
    q_next = torch.where((accepted < num_drafts)[:, None], q_next, torch.zeros_like(q_next))
    residual = (p_next - q_next).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # total == 0 only if p == q, where rejection has probability 0; fall back to p for safety.
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_next)
    return accepted, sample_from(residual, sample_uniforms)


def greedy_accept(proposal: list[int], target_choice: list[int]) -> int:
    """How many proposals greedy decoding accepts: the longest prefix of `proposal` equal to the
    target's argmax at each position (`target_choice[j]`: the target's token after the first j
    proposals). `speculative_accept` with one-hot p and q gives the same count, and the token
    after them is then `target_choice[accepted]`.
    """
    accepted = 0
    for proposed, chosen in zip(proposal, target_choice, strict=False):  # target_choice has one more
        if proposed != chosen:
            break
        accepted += 1
    return accepted


def expected_tokens_per_pass(acceptance_rate: float, gamma: int) -> float:
    """Leviathan et al. 2023, eq. 1: (1 - a^(gamma+1)) / (1 - a) tokens per target forward."""
    if acceptance_rate >= 1:
        return gamma + 1.0
    return (1 - acceptance_rate ** (gamma + 1)) / (1 - acceptance_rate)


def proposal_distributions(proposals: list[list[int]], drafted: list[int],
                           draft_probs: Tensor | None) -> Tensor | None:
    """q for `speculative_accept`, [B, K, V]: the draft's distributions at the first
    `drafted[i]` proposals of row i, a point mass on each proposed token after them (prompt
    lookup, a deterministic function of the context); None when the draft proposed nothing
    (the acceptance test then treats every proposal as a point mass)."""
    if draft_probs is None or not any(drafted):
        return None
    width = max(len(p) for p in proposals)
    batch, steps, vocab = draft_probs.shape
    device = draft_probs.device
    q = torch.zeros(batch, width, vocab, dtype=draft_probs.dtype, device=device)
    q[:, : min(steps, width)] = draft_probs[:, :width]
    for i, (proposal, n) in enumerate(zip(proposals, drafted, strict=True)):
        if len(proposal) > n:
            q[i, n:] = 0
            q[i, torch.arange(n, len(proposal), device=device),
              torch.tensor(proposal[n:], dtype=torch.long, device=device)] = 1.0
    return q
