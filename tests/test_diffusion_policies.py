"""Sampling policies on hand-made numbers: proposals, scores and the commit rules."""

from __future__ import annotations

import pytest
import torch

from nowait.engines.diffusion.policies import (
    choose_commits,
    commit_above_threshold,
    commit_by_factor,
    commit_fixed,
    filter_top_k_top_p,
    fixed_count,
    gumbel_noise,
    inverse_perplexity,
    position_scores,
    propose_tokens,
    top2_margin,
)

SCORE = torch.tensor([[0.95, 0.40, 0.91, 0.99, 0.20, 0.90],
                      [0.30, 0.10, 0.50, 0.20, 0.45, 0.05],
                      [0.99, 0.99, 0.99, 0.99, 0.99, 0.99]])
MASKED = torch.tensor([[True, True, True, False, True, True],
                       [True, True, True, True, True, True],
                       [False] * 6])


def test_threshold_commits_exactly_the_sure_masked_positions():
    chosen = commit_above_threshold(SCORE, MASKED, tau=0.9)
    # Row 0: 0.95, 0.91 and 0.90 pass; 0.99 is already committed (not masked).
    assert chosen[0].tolist() == [True, False, True, False, False, True]
    # Row 1: nothing reaches tau, so the single most confident masked position goes.
    assert chosen[1].tolist() == [False, False, True, False, False, False]
    # Row 2: nothing masked, nothing committed.
    assert not chosen[2].any()


def test_threshold_of_one_commits_one_at_a_time_unless_certain():
    chosen = commit_above_threshold(SCORE, MASKED, tau=1.0)
    assert chosen.sum(-1).tolist() == [1, 1, 0]
    certain = torch.tensor([[1.0, 1.0, 0.3]])
    assert commit_above_threshold(certain, torch.ones(1, 3, dtype=torch.bool), 1.0).tolist() == [[True, True, False]]


def test_factor_rule_takes_the_largest_n_with_few_expected_errors():
    score = torch.tensor([[0.5, 0.99, 0.9, 0.95]])
    masked = torch.ones(1, 4, dtype=torch.bool)
    # Sorted: 0.99, 0.95, 0.9, 0.5; (n+1)(1-c_n): 0.02, 0.15, 0.4, 2.5.
    assert commit_by_factor(score, masked, factor=1.0).tolist() == [[False, True, True, True]]
    assert commit_by_factor(score, masked, factor=0.2).tolist() == [[False, True, False, True]]
    assert commit_by_factor(score, masked, factor=0.01).tolist() == [[False, True, False, False]]  # at least one
    # Unmasked positions never count, however sure.
    partly = torch.tensor([[True, False, True, True]])
    assert commit_by_factor(score, partly, factor=1.0).tolist() == [[False, False, True, True]]


def test_fixed_count_matches_llada_schedule():
    # LLaDA spreads n masked positions over s steps as n // s each, the remainder first.
    for n in range(0, 40):
        for steps in range(1, 9):
            expected = [n // steps + (i < n % steps) for i in range(steps)]
            counts, left = [], n
            for i in range(steps):
                count = fixed_count(left, steps - i)
                counts.append(count)
                left -= count
            assert counts == expected


def test_fixed_commits_the_most_confident():
    assert commit_fixed(SCORE, MASKED, 2)[0].tolist() == [True, False, True, False, False, False]
    assert choose_commits("fixed", SCORE, MASKED, count=1)[1].tolist() == [False, False, True, False, False, False]


def test_choose_commits_dispatches_and_rejects_unknown():
    assert torch.equal(choose_commits("threshold", SCORE, MASKED, tau=0.9), commit_above_threshold(SCORE, MASKED, 0.9))
    assert torch.equal(choose_commits("factor", SCORE, MASKED, factor=1.0), commit_by_factor(SCORE, MASKED, 1.0))
    with pytest.raises(ValueError):
        choose_commits("random", SCORE, MASKED)


def test_scores_margin_and_entropy():
    probabilities = torch.tensor([[0.5, 0.45, 0.05], [0.9, 0.05, 0.05], [1.0, 0.0, 0.0]])
    assert torch.allclose(top2_margin(probabilities), torch.tensor([0.05, 0.85, 1.0]))
    sure = inverse_perplexity(probabilities)
    assert sure[2] == pytest.approx(1.0) and sure[1] > sure[0]
    chosen = probabilities.max(-1).values
    assert torch.equal(position_scores("probability", probabilities, chosen), chosen)
    with pytest.raises(ValueError):
        position_scores("loudness", probabilities, chosen)


def test_proposals_greedy_and_seeded_sampling():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    assert propose_tokens(logits, 0.0).unique().tolist() == [0]
    first = propose_tokens(logits, 1.0, gumbel_noise(tuple(logits.shape), torch.Generator().manual_seed(5)))
    again = propose_tokens(logits, 1.0, gumbel_noise(tuple(logits.shape), torch.Generator().manual_seed(5)))
    assert torch.equal(first, again)
    frequencies = torch.bincount(first, minlength=3).float() / len(first)
    assert torch.allclose(frequencies, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)  # Gumbel-max samples softmax


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.5)).tolist() == [[False, True, True, True]]
    assert torch.equal(filter_top_k_top_p(logits, 0, 1.0), logits)
