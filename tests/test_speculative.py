"""Speculative decoding: the target's distribution is preserved, greedy output is the target's."""

from __future__ import annotations

import pytest
import torch

from nowait.engines.ar.engine import AutoregressiveEngine, EngineConfig
from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.speculative import (
    IncompatibleDraftError,
    PromptLookup,
    SpeculativeConfig,
    SpeculativeEngine,
    expected_tokens_per_pass,
    greedy_accept,
    propose_from_draft,
    propose_ngram,
    should_speculate,
    speculative_accept,
)
from nowait.engines.speculative.acceptance import proposal_distributions
from tests.conftest import build_model, swapped_codec

END = 0
# chi-square critical values at p = 0.001 (the tests are seeded, so they are deterministic)
CHI2_999 = {5: 20.52, 24: 51.18}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def random_distributions(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 1.2).softmax(-1)


@pytest.mark.parametrize("point_mass", [False, True])
def test_one_proposal_leaves_the_target_distribution(point_mass):
    """Leviathan et al. 2023, Theorem 1: draft ~ q, accept w.p. min(1, p/q), else the
    residual; the emitted token is distributed as p (for a model draft and for a fixed one)."""
    vocab, trials = 6, 60_000
    p, q = random_distributions(2, vocab, seed=3)
    g = torch.Generator().manual_seed(0)
    if point_mass:  # prompt lookup: always the same proposal, q = delta
        drafts = torch.full((trials, 1), int(q.argmax()))
        draft_probs = None
    else:
        drafts = torch.multinomial(q, trials, replacement=True, generator=g)[:, None]
        draft_probs = q.expand(trials, 1, vocab)
    target = torch.stack([p, p]).expand(trials, 2, vocab)  # p after the proposal: unused here
    accepted, following = speculative_accept(drafts, torch.ones(trials, dtype=torch.long), target, draft_probs,
                                             torch.rand(trials, 1, generator=g), torch.rand(trials, generator=g))
    first = torch.where(accepted == 1, drafts[:, 0], following)
    counts = torch.bincount(first, minlength=vocab).float()
    assert chi_square(counts, p) < CHI2_999[vocab - 1]
    if not point_mass:  # acceptance rate is sum_x min(p, q) (Leviathan et al. 2023, section 3.3)
        assert accepted.float().mean().item() == pytest.approx(torch.minimum(p, q).sum().item(), abs=0.01)


def test_a_chain_of_proposals_leaves_the_joint_target_distribution():
    """Two drafted tokens with context-dependent p and q: the first two emitted tokens are
    distributed as p1(a) p2(b | a); when only one is emitted, the next step draws b from p2."""
    vocab, trials = 5, 80_000
    g = torch.Generator().manual_seed(1)
    p1, q1 = random_distributions(2, vocab, seed=10)
    p2 = random_distributions(vocab, vocab, seed=11)  # p2[a] = p(. | a)
    q2 = random_distributions(vocab, vocab, seed=12)
    p3 = random_distributions(vocab, vocab, seed=13)  # after both proposals (depends on the 2nd)
    x1 = torch.multinomial(q1, trials, replacement=True, generator=g)
    x2 = torch.multinomial(q2[x1], 1, generator=g)[:, 0]
    target = torch.stack([p1.expand(trials, -1), p2[x1], p3[x2]], dim=1)
    draft = torch.stack([q1.expand(trials, -1), q2[x1]], dim=1)
    accepted, following = speculative_accept(torch.stack([x1, x2], 1), torch.full((trials,), 2), target, draft,
                                             torch.rand(trials, 2, generator=g), torch.rand(trials, generator=g))
    a = torch.where(accepted >= 1, x1, following)
    b_next_step = torch.multinomial(p2[a], 1, generator=g)[:, 0]
    b = torch.where(accepted == 2, x2, torch.where(accepted == 1, following, b_next_step))
    counts = torch.bincount(a * vocab + b, minlength=vocab * vocab).float()
    joint = (p1[:, None] * p2).flatten()
    assert chi_square(counts, joint) < CHI2_999[vocab * vocab - 1]


def test_greedy_acceptance_is_argmax_agreement():
    target = torch.eye(4)[[2, 1, 3]][None]  # one-hot: argmax 2, then 1, then 3
    draft = torch.eye(4)[[2, 0]][None]
    accepted, following = speculative_accept(torch.tensor([[2, 0]]), torch.tensor([2]), target, draft,
                                             torch.full((1, 2), 0.99), torch.tensor([0.5]))
    assert accepted.tolist() == [1] and following.tolist() == [1]  # the target's token replaces the miss


@pytest.mark.parametrize(("proposer", "prompt"), [
    ({"method": "draft"}, [1, 2, 3, 1]),
    ({"method": "draft", "draft_confidence": 0.5}, [1, 2, 3, 1]),  # drafting stops at a doubt
    # prompt lookup finishing proposals the draft model started: point masses after drafted
    # positions in one proposal (the prompt's last token is new, so the draft starts)
    ({"method": "hybrid", "hybrid_min_ngram": 2, "lookup_gamma": 1}, [1, 2, 3, 0]),
])
def test_engine_sampling_preserves_the_target_distribution(proposer, prompt):
    """End to end through the engine (draft model, cache rollback, per-row uniforms): the
    first three tokens of many seeded samples match the target's exact joint distribution."""
    vocab, end = 5, 4
    target, draft = build_model(3, vocab_size=vocab), build_model(8, vocab_size=vocab, num_layers=1)
    engine = SpeculativeEngine(target, end_id=end, draft=draft,
                               config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=512),
                               speculative=SpeculativeConfig(gamma=2, max_batch=64, **proposer))
    trials = 4000
    # 4 tokens, so the first decode step may propose 2 (the verify adds one of its own)
    completions = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=i))
                                   for i in range(trials)])
    assert sum(c.draft_tokens_proposed for c in completions) > trials // 2  # speculation did run
    outcomes = [tuple(c.token_ids[:3]) for c in completions]
    exact = exact_outcomes(target, prompt, vocab, end, length=3)
    keys = sorted(exact, key=lambda k: (len(k), k))
    expected = torch.tensor([exact[k] for k in keys])
    assert expected.sum().item() == pytest.approx(1.0, abs=1e-4)
    counts = torch.tensor([outcomes.count(k) for k in keys], dtype=torch.float)
    # pool the rare outcomes so every cell expects at least 5 draws
    rare = expected * trials < 5
    counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])
    expected = torch.cat([expected[~rare], expected[rare].sum(0, keepdim=True)])
    statistic = chi_square(counts, expected)
    degrees = len(counts) - 1
    assert statistic < degrees + 4 * (2 * degrees) ** 0.5  # far beyond p = 0.001 for ~60-85 cells


@torch.no_grad()
def exact_outcomes(model, prompt: list[int], vocab: int, end: int, length: int) -> dict[tuple, float]:
    """The probability of every possible output of at most `length` tokens (end excluded)."""
    outcomes: dict[tuple, float] = {}

    def walk(prefix: list[int], probability: float) -> None:
        if len(prefix) == length:
            outcomes[tuple(prefix)] = probability
            return
        nxt = model(torch.tensor([prompt + prefix]))[0, -1].softmax(-1).tolist()
        for token in range(vocab):
            if token == end:
                outcomes[tuple(prefix)] = probability * nxt[token]
            else:
                walk([*prefix, token], probability * nxt[token])

    walk([], 1.0)
    return outcomes


def prompts(count: int, seed: int = 1, vocab: int = 64) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # repeated motifs give prompt lookup something to find
    motif = torch.randint(1, vocab, (6,), generator=g).tolist()
    out = []
    for n in torch.randint(4, 30, (count,), generator=g).tolist():
        body = torch.randint(1, vocab, (n,), generator=g).tolist()
        out.append(body[: n // 2] + motif + body[n // 2:] + motif[:3])
    return out


def greedy_requests(ids: list[list[int]], max_tokens: int = 24) -> list[GenerationRequest]:
    return [GenerationRequest(p, SamplingParams(max_tokens=max_tokens)) for p in ids]


@pytest.fixture(scope="module")
def target():
    return build_model(0)


PROPOSERS = {
    "draft": {"method": "draft"},
    "ngram": {"method": "ngram"},
    "hybrid": {"method": "hybrid", "hybrid_min_ngram": 2},
    "draft-adaptive": {"method": "draft", "draft_confidence": 0.3},
    "hybrid-adaptive": {"method": "hybrid", "draft_confidence": 0.3, "hybrid_min_ngram": 1, "lookup_gamma": 2},
}


@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("max_batch", [1, 3, 16])  # never, sometimes, always speculating
def test_greedy_output_is_the_targets_token_for_token(target, proposer, max_batch):
    ids = prompts(6)
    reference = AutoregressiveEngine(target, end_id=END).generate(greedy_requests(ids))
    engine = SpeculativeEngine(target, end_id=END, draft=build_model(1, num_layers=1),
                               config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=128),
                               speculative=SpeculativeConfig(gamma=3, max_batch=max_batch, **PROPOSERS[proposer]))
    batched = engine.generate(greedy_requests(ids))
    alone = [engine.generate(greedy_requests([p]))[0] for p in ids]
    again = [engine.generate(greedy_requests([p]))[0] for p in ids]
    assert [c.token_ids for c in batched] == [c.token_ids for c in reference]
    assert [c.token_ids for c in alone] == [c.token_ids for c in reference]
    assert all(c.finish_reason == r.finish_reason for c, r in zip(alone, reference, strict=True))
    assert sum(c.draft_tokens_proposed for c in alone) > 0
    # The same prompts a third time: their blocks come from the target's prefix cache (stored at
    # the second sighting), and the draft model still catches up on the whole prompt.
    assert [c.token_ids for c in again] == [c.token_ids for c in reference]
    assert any(c.cached_prompt_tokens for c in again)
    # The draft sees the whole prompt as before: it proposes and is accepted exactly as alone.
    assert [(c.draft_tokens_proposed, c.draft_tokens_accepted) for c in again] == \
        [(c.draft_tokens_proposed, c.draft_tokens_accepted) for c in alone]


def test_the_draft_catching_up_on_long_prompts_keeps_to_the_token_cap(target):
    """New rows feed their prompts to the draft model in chunks, like the target's prefill: no
    draft forward computes more than max_num_batched_tokens positions, and output is unchanged."""
    draft = build_model(1, num_layers=1)
    ids = [p * 4 for p in prompts(4, seed=3)]  # 16-116 tokens each
    sizes = []
    forward = draft.forward

    def recording(input_ids, *args, **kwargs):
        sizes.append(input_ids.shape[0] * input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    draft.forward = recording
    engine = SpeculativeEngine(target, end_id=END, draft=draft,
                               config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=32),
                               speculative=SpeculativeConfig(gamma=3, max_batch=16, method="draft"))
    reference = AutoregressiveEngine(target, end_id=END).generate(greedy_requests(ids))
    assert [c.token_ids for c in engine.generate(greedy_requests(ids))] == [c.token_ids for c in reference]
    assert sizes and max(sizes) <= 32 and max(len(p) for p in ids) > 32


def test_a_doubtful_draft_stops_early():
    """draft_confidence: drafting stops after the first proposal the draft is unsure of, so
    fewer draft forwards and proposals than gamma per step; the output is unchanged."""
    target, draft = build_model(0), build_model(1, num_layers=1)
    ids = prompts(3, seed=7)
    reference = AutoregressiveEngine(target, end_id=END).generate(greedy_requests(ids))

    def run(confidence):
        engine = SpeculativeEngine(target, end_id=END, draft=draft,
                                   speculative=SpeculativeConfig(method="draft", gamma=6, draft_confidence=confidence))
        return [engine.generate(greedy_requests([p]))[0] for p in ids]

    always, adaptive = run(0.0), run(0.9)
    assert [c.token_ids for c in adaptive] == [c.token_ids for c in reference] == [c.token_ids for c in always]
    assert sum(c.draft_tokens_proposed for c in adaptive) < sum(c.draft_tokens_proposed for c in always)
    assert sum(c.draft_forwards for c in adaptive) < sum(c.draft_forwards for c in always)


def test_a_perfect_draft_accepts_everything():
    target = build_model(0)
    engine = SpeculativeEngine(target, end_id=END, draft=target,
                               speculative=SpeculativeConfig(method="draft", gamma=4))
    completion = engine.generate(greedy_requests(prompts(1), max_tokens=21))[0]
    assert completion.acceptance_rate == 1.0
    # 1 prefill + 4 verifies of 5 tokens each = 21 tokens in 5 target forwards
    assert completion.forwards == 5 and completion.tokens_per_forward == pytest.approx(21 / 5)
    assert completion.draft_forwards > 0


def test_stop_tokens_and_max_tokens_with_speculation(target):
    ids = prompts(1, seed=4)[0]
    ar = AutoregressiveEngine(target, end_id=END)
    free = ar.generate(greedy_requests([ids], max_tokens=15))[0]
    stop = free.token_ids[6]
    engine = SpeculativeEngine(target, end_id=END, draft=target, speculative=SpeculativeConfig(gamma=4))
    capped = engine.generate(greedy_requests([ids], max_tokens=7))[0]
    assert capped.token_ids == free.token_ids[:7] and capped.finish_reason == "length"
    request = GenerationRequest(ids, SamplingParams(max_tokens=15, stop_token_ids=(stop,)))
    stopped = engine.generate([request])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: free.token_ids.index(stop)]


@pytest.mark.parametrize("proposer", ["draft", "ngram", "hybrid"])
def test_a_second_end_id_stops_speculation_as_it_stops_ar(target, proposer):
    """An end id proposed or accepted mid-proposal ends the sequence there (Llama 3's <|eot_id|>
    beside <|end_of_text|>), as in the AR engine, with finish_reason stop."""
    ids = prompts(3, seed=4)
    free = AutoregressiveEngine(target, end_id=END).generate(greedy_requests(ids, max_tokens=15))
    second = free[0].token_ids[5]
    reference = AutoregressiveEngine(target, end_ids=(END, second)).generate(greedy_requests(ids, max_tokens=15))
    engine = SpeculativeEngine(target, end_ids=(END, second), draft=build_model(1, num_layers=1),
                               speculative=SpeculativeConfig(gamma=4, **PROPOSERS[proposer]))
    assert engine.end_ids == (END, second)
    completions = [engine.generate(greedy_requests([p], max_tokens=15))[0] for p in ids]
    assert [c.token_ids for c in completions] == [c.token_ids for c in reference]
    assert completions[0].finish_reason == "stop" and second not in completions[0].token_ids
    assert [c.finish_reason for c in completions] == [c.finish_reason for c in reference]


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(target, codec):
    """Same vocabulary size, other ids: refused when both tokenizers are given, with the reason."""
    model = build_model(0, vocab_size=codec.vocab_size)
    draft = build_model(1, vocab_size=codec.vocab_size, num_layers=1)
    for method in ("draft", "hybrid"):
        with pytest.raises(IncompatibleDraftError, match="tokenizer"):
            SpeculativeEngine(model, codec, draft=draft, draft_codec=swapped_codec(codec),
                              speculative=SpeculativeConfig(method=method))
        engine = SpeculativeEngine(model, codec, draft=draft, draft_codec=codec,
                                   speculative=SpeculativeConfig(method=method))
        assert engine.draft is draft


def test_greedy_accept_is_speculative_accept_with_one_hot_distributions():
    """The greedy fast path takes the same tokens as the general acceptance test would."""
    g = torch.Generator().manual_seed(5)
    vocab = 6
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=g))
        choice = torch.randint(0, vocab, (k + 1,), generator=g)
        # proposals that agree with the target for a random while, then random
        proposal = torch.where(torch.rand(k, generator=g) < 0.7, choice[:k], torch.randint(0, vocab, (k,), generator=g))
        accepted = greedy_accept(proposal.tolist(), choice.tolist())
        target = torch.eye(vocab)[choice][None]
        reference, following = speculative_accept(proposal[None], torch.tensor([k]), target, None,
                                                  torch.full((1, k), 0.5), torch.tensor([0.5]))
        assert accepted == int(reference) and choice[accepted] == following[0]


def test_prompt_lookup_index_proposes_what_propose_ngram_does():
    g = torch.Generator().manual_seed(2)
    for max_ngram, min_ngram in [(3, 1), (4, 2), (1, 1)]:
        tokens = torch.randint(1, 5, (80,), generator=g).tolist()  # small alphabet: many repeats
        lookup = PromptLookup(max_ngram, min_ngram)
        for length in range(1, len(tokens) + 1):
            lookup.extend(tokens[len(lookup.tokens): length])
            proposal, matched = lookup.propose(4)
            assert proposal == propose_ngram(tokens[:length], 4, max_ngram, min_ngram)
            assert (matched > 0) == bool(proposal) and (not proposal or min_ngram <= matched <= max_ngram)


def test_prompt_lookup_in_the_prompt_only_and_after_drafted_tokens():
    prompt = [7, 8, 9, 4, 5, 6]
    lookup = PromptLookup(3, 2, search_limit=len(prompt))
    lookup.extend([*prompt, 1, 2, 3, 1, 2])
    assert lookup.propose(3) == ([], 0)  # [1, 2] occurs earlier, but in the output
    lookup.extend([7, 8])
    assert lookup.propose(3) == ([9, 4, 5], 2)
    assert lookup.propose(2, drafted=[9, 4]) == ([5, 6], 3)  # the suffix ends in the drafted tokens
    assert lookup.propose(2, drafted=[3]) == ([], 0)


def test_proposal_distributions_are_point_masses_after_the_drafted_tokens():
    vocab = 4
    drafted_q = torch.full((2, 2, vocab), 0.25)
    q = proposal_distributions([[1, 2, 3], [0]], [1, 0], drafted_q)
    assert q.shape == (2, 3, vocab)
    assert torch.equal(q[0, 0], drafted_q[0, 0])  # drafted by the model: its distribution
    assert q[0, 1].tolist() == [0, 0, 1, 0] and q[0, 2].tolist() == [0, 0, 0, 1]  # looked up
    assert q[1, 0].tolist() == [1, 0, 0, 0]
    assert proposal_distributions([[1], [2]], [0, 0], drafted_q) is None


def test_prompt_lookup_proposals():
    assert propose_ngram([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert propose_ngram([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]  # the latest occurrence
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([7, 1, 9, 2, 7], 2, max_ngram=3) == [1, 9]  # falls back to a 1-gram
    assert propose_ngram([7, 1, 9, 2, 7], 2, min_ngram=2) == []
    assert propose_ngram([3, 3, 3], 5) == [3]


def test_expected_tokens_per_pass_and_the_skip_rule():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert should_speculate(1, 4, max_batch=4, token_cap=4096)
    assert not should_speculate(5, 4, max_batch=4, token_cap=4096)
    assert not should_speculate(4, 4, max_batch=4, token_cap=16)  # 4 x 5 positions > cap


def test_a_draft_with_another_vocabulary_is_refused(target):
    with pytest.raises(IncompatibleDraftError, match="vocabulary"):
        SpeculativeEngine(target, end_id=END, draft=build_model(1, vocab_size=80))
    with pytest.raises(IncompatibleDraftError, match="causal"):
        SpeculativeEngine(target, end_id=END, draft=build_model(1, causal=False))
    with pytest.raises(IncompatibleDraftError, match="draft model"):
        SpeculativeEngine(target, end_id=END, speculative=SpeculativeConfig(method="draft"))
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeEngine(target, end_id=END, speculative=SpeculativeConfig(method="ngram", gamma=0))
    with pytest.raises(IncompatibleDraftError, match="draft model"):
        SpeculativeEngine(target, end_id=END, speculative=SpeculativeConfig(method="hybrid"))
    for bad, message in [({"draft_confidence": 1.0}, "draft_confidence"), ({"lookup_gamma": 0}, "lookup_gamma"),
                         ({"answer_gamma": 0}, "answer_gamma"),
                         ({"hybrid_min_ngram": 4}, "hybrid_min_ngram"), ({"method": "tree"}, "method")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**bad).validate()


def test_seeded_sampling_alone_equals_batched_when_speculating(target):
    ids = prompts(4, seed=9)
    engine = SpeculativeEngine(target, end_id=END, draft=build_model(1, num_layers=1),
                               speculative=SpeculativeConfig(method="draft", gamma=3, max_batch=8))

    def run(batch):
        return [GenerationRequest(p, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
                for i, p in enumerate(ids) if i in batch]

    alone = [engine.generate(run({i}))[0].token_ids for i in range(len(ids))]
    assert [c.token_ids for c in engine.generate(run(set(range(len(ids)))))] == alone


# --- speculative diffusion decoding: a drafted answer, verified by the target ---


def test_a_drafted_answer_is_proposed_from_where_the_output_stands():
    draft = [10, 11, 12, 13, 14, 15, 16]
    assert propose_from_draft(draft, [], 3) == ([10, 11, 12], 0)
    assert propose_from_draft(draft, [10, 11, 12], 2) == ([13, 14], 0)
    assert propose_from_draft(draft, [10, 11], 0) == ([], 0)
    # The target replaced 12 by 99: the draft goes on where it stood (13 ...), alignment kept.
    assert propose_from_draft(draft, [10, 11, 99], 3) == ([13, 14, 15], 0)
    # The target inserted 99 after 12: its next tokens, 13 14 ..., are re-found one later.
    assert propose_from_draft(draft, [10, 11, 12, 99, 13, 14], 2) == ([15, 16], -1)
    # The target skipped 12: "11 13" is not in the draft, "13 14" after it is, one earlier.
    assert propose_from_draft(draft, [10, 11, 13, 14], 2, shift=0) == ([15, 16], 1)
    # A shift found once is kept: the output standing at 5 is at 6 in the draft.
    assert propose_from_draft(draft, [10, 11, 12, 99, 13], 2, shift=-1, min_ngram=3) == ([14, 15], -1)


def test_a_repeated_pattern_is_matched_nearest_the_alignment():
    draft = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 9]
    # "1 2 3" ends at 3, 7 and 11: the output stands at 7, so 8 follows
    assert propose_from_draft(draft, [1, 2, 3, 7, 1, 2, 3], 1) == ([8], 0)
    assert propose_from_draft(draft, [5, 5, 5, 1, 2, 3], 1, shift=4) == ([9], 5)


def test_a_short_match_where_the_output_stands_beats_a_long_one_far_away():
    draft = [5, 1, 2, 30, 7, 1, 2, 31, 40, 41]
    assert propose_from_draft(draft, [5, 1, 2, 30, 5, 1, 2], 3) == ([31, 40, 41], 0)


def test_propose_from_draft_never_proposes_past_the_draft():
    assert propose_from_draft([4, 5], [4, 5], 3) == ([], 0)
    assert propose_from_draft([4, 5], [4, 5, 6, 7, 8], 3) == ([], 0)


@pytest.fixture(scope="module")
def drafter(codec):
    from nowait.engines.diffusion.engine import DiffusionEngine

    model = build_model(5, vocab_size=codec.vocab_size, causal=False, mask_token_id=codec.mask_id)
    return DiffusionEngine(model, codec, max_batch=4)


@pytest.fixture(scope="module")
def codec_target(codec):
    return build_model(0, vocab_size=codec.vocab_size)


def codec_prompts(codec, count: int) -> list[list[int]]:
    return [codec.encode(f"Invoice {n}: total {n * 17} EUR, due {n + 3} days.") for n in range(count)]


@pytest.mark.parametrize("max_batch", [1, 4])  # speculating alone, and in a batch of three
def test_a_diffusion_drafter_leaves_greedy_output_the_targets(codec, codec_target, drafter, max_batch):
    """A random diffusion model drafts answers the target mostly rejects: the output is still
    the target's own, alone and batched, and the drafter's forwards are counted."""
    ids = codec_prompts(codec, 3)
    reference = AutoregressiveEngine(codec_target, codec).generate(greedy_requests(ids, max_tokens=16))
    engine = SpeculativeEngine(codec_target, codec, drafter=drafter,
                               speculative=SpeculativeConfig(method="diffusion", gamma=8, max_batch=max_batch))
    batched = engine.generate(greedy_requests(ids, max_tokens=16))
    alone = [engine.generate(greedy_requests([p], max_tokens=16))[0] for p in ids]
    for run in (batched, alone):
        assert [c.token_ids for c in run] == [c.token_ids for c in reference]
        assert [c.finish_reason for c in run] == [c.finish_reason for c in reference]
    assert all(c.draft_forwards > 0 for c in alone) and sum(c.draft_tokens_proposed for c in alone) > 0


def test_a_right_drafted_answer_is_verified_in_few_forwards(codec, codec_target, drafter):
    """`draft_ids` = the target's own answer: everything is accepted, gamma tokens per verify,
    and the drafter never runs. A draft with one token replaced, one dropped and one added
    still gives the target's output, re-aligning after each miss."""
    prompt = codec_prompts(codec, 1)[0]
    answer = AutoregressiveEngine(codec_target, codec).generate(greedy_requests([prompt], max_tokens=30))[0]
    assert len(answer.token_ids) == 30
    engine = SpeculativeEngine(codec_target, codec, drafter=drafter,
                               speculative=SpeculativeConfig(method="diffusion", gamma=8, answer_gamma=8))
    right = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=30), draft_ids=answer.token_ids)])[0]
    assert right.token_ids == answer.token_ids and right.draft_forwards == 0
    assert right.acceptance_rate == 1.0
    # prefill (1 token) + verifies of pending + 8: 1 + 9 + 9 + 9 = 28, then the last 2
    assert right.forwards == 1 + 4
    ids = list(answer.token_ids)
    wrong = [*ids[:5], (ids[5] + 1) % codec.vocab_size, *ids[6:12], *ids[13:20], ids[20], ids[20], *ids[21:]]
    fixed = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=30), draft_ids=wrong)])[0]
    assert fixed.token_ids == answer.token_ids
    # three misses, each costing about one verify more than the right draft's four
    assert fixed.draft_tokens_accepted >= 24 and fixed.forwards <= 1 + 4 + 1


def test_a_drafted_answer_is_proposed_with_the_end_token_after_it(codec, codec_target, drafter):
    """The end token follows a drafted answer, so the verify that accepts the answer also ends
    the sequence (here the target's end token is one its answer reaches)."""
    prompt = codec_prompts(codec, 2)[1]
    free = AutoregressiveEngine(codec_target, codec).generate(greedy_requests([prompt], max_tokens=12))[0]
    cut = next(i for i in range(4, 12) if free.token_ids[i] not in free.token_ids[:i])
    end = free.token_ids[cut]
    engine = SpeculativeEngine(codec_target, codec, end_id=end, drafter=drafter,
                               speculative=SpeculativeConfig(method="diffusion", gamma=16))
    request = GenerationRequest(prompt, SamplingParams(max_tokens=12), draft_ids=free.token_ids[:cut])
    done = engine.generate([request])[0]
    assert done.token_ids == free.token_ids[:cut] and done.finish_reason == "stop"
    assert done.forwards == 2  # the prefill, and one verify that accepts the answer and its end


def test_seeded_sampling_with_a_drafted_answer_alone_equals_batched(codec, codec_target, drafter):
    ids = codec_prompts(codec, 3)
    engine = SpeculativeEngine(codec_target, codec, drafter=drafter,
                               speculative=SpeculativeConfig(method="diffusion", gamma=4, max_batch=8))

    def run(batch):
        return [GenerationRequest(p, SamplingParams(max_tokens=10, temperature=1.0, seed=i))
                for i, p in enumerate(ids) if i in batch]

    alone = [engine.generate(run({i}))[0] for i in range(len(ids))]
    assert [c.token_ids for c in engine.generate(run(set(range(len(ids)))))] == [c.token_ids for c in alone]
    assert all(c.draft_tokens_proposed > 0 for c in alone)


def test_a_prompt_that_leaves_the_drafter_no_room_decodes_without_proposals(codec, drafter):
    """The prompt fills the drafter's positions (not the target's): the target decodes alone,
    and still gives its own output."""
    target = build_model(0, vocab_size=codec.vocab_size, max_position=1024)
    prompt = codec_prompts(codec, 1)[0] * 30  # about 500 tokens: + 16 fits the target, not the drafter's 512
    reference = AutoregressiveEngine(target, codec).generate(greedy_requests([prompt], max_tokens=16))[0]
    engine = SpeculativeEngine(target, codec, drafter=drafter, speculative=SpeculativeConfig(method="diffusion"))
    done = engine.generate(greedy_requests([prompt], max_tokens=16))[0]
    assert done.token_ids == reference.token_ids and done.draft_tokens_proposed == 0


def test_a_drafter_that_cannot_serve_the_target_is_refused(codec, codec_target, drafter):
    from nowait.engines.base import InvalidRequestError
    from nowait.engines.diffusion.engine import DiffusionEngine

    with pytest.raises(IncompatibleDraftError, match="diffusion drafter"):
        SpeculativeEngine(codec_target, codec, speculative=SpeculativeConfig(method="diffusion"))
    with pytest.raises(IncompatibleDraftError, match="vocabulary"):
        SpeculativeEngine(build_model(0), codec, drafter=drafter, speculative=SpeculativeConfig(method="diffusion"))
    other = DiffusionEngine(drafter.model, swapped_codec(codec))
    with pytest.raises(IncompatibleDraftError, match="tokenizer"):
        SpeculativeEngine(codec_target, codec, drafter=other, speculative=SpeculativeConfig(method="diffusion"))
    with pytest.raises(ValueError, match="drafter_tau"):
        SpeculativeConfig(method="diffusion", drafter_tau=0.0).validate()
    engine = SpeculativeEngine(codec_target, codec, drafter=drafter, speculative=SpeculativeConfig(method="diffusion"))
    with pytest.raises(InvalidRequestError, match="draft_ids"):
        engine.generate([GenerationRequest([5, 6], draft_ids=[codec.vocab_size])])


@pytest.mark.parametrize("proposer", ["draft", "ngram", "hybrid"])
def test_every_method_verifies_an_answer_the_request_brings(codec, codec_target, proposer):
    """`draft_ids` outranks the method's own proposals: the right answer is accepted whole,
    gamma tokens per verify, without draft forwards; a request without one drafts as before."""
    prompt = codec_prompts(codec, 1)[0]
    answer = AutoregressiveEngine(codec_target, codec).generate(greedy_requests([prompt], max_tokens=20))[0]
    draft = build_model(1, vocab_size=codec.vocab_size, num_layers=1)
    engine = SpeculativeEngine(codec_target, codec, draft=draft,
                               speculative=SpeculativeConfig(gamma=4, answer_gamma=4, **PROPOSERS[proposer]))
    right = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=20), draft_ids=answer.token_ids)])[0]
    assert right.token_ids == answer.token_ids and right.acceptance_rate == 1.0
    assert right.draft_forwards == 0 and right.forwards == 1 + 4  # 4 verifies of 5 tokens, the last one short
    # By default a drafted answer is verified answer_gamma (64) tokens at a time, whatever gamma.
    wide = SpeculativeEngine(codec_target, codec, draft=draft,
                             speculative=SpeculativeConfig(gamma=4, **PROPOSERS[proposer]))
    whole = wide.generate([GenerationRequest(prompt, SamplingParams(max_tokens=20), draft_ids=answer.token_ids)])[0]
    assert whole.token_ids == answer.token_ids and whole.forwards == 2  # the prefill and one verify
    plain = engine.generate(greedy_requests([prompt], max_tokens=20))[0]
    assert plain.token_ids == answer.token_ids and plain.acceptance_rate != 1.0


class FailingDrafter:
    """A drafter whose every run fails (a device error, say), wrapping a real one for its checks."""

    def __init__(self, real) -> None:
        self.model, self.codec = real.model, real.codec

    def generate(self, requests):
        raise RuntimeError("out of memory")


class RecordingDrafter(FailingDrafter):
    def __init__(self, real) -> None:
        super().__init__(real)
        self.real, self.requests = real, []

    def generate(self, requests):
        self.requests += requests
        return self.real.generate(requests)


def test_a_failing_drafter_leaves_the_target_decoding(codec, codec_target, drafter):
    ids = codec_prompts(codec, 2)
    reference = AutoregressiveEngine(codec_target, codec).generate(greedy_requests(ids, max_tokens=12))
    engine = SpeculativeEngine(codec_target, codec, drafter=FailingDrafter(drafter),
                               speculative=SpeculativeConfig(method="diffusion", max_batch=4))
    done = engine.generate(greedy_requests(ids, max_tokens=12))
    assert [c.token_ids for c in done] == [c.token_ids for c in reference]
    assert [c.finish_reason for c in done] == [c.finish_reason for c in reference]
    assert all(c.draft_tokens_proposed == 0 for c in done)


def test_the_drafter_decodes_greedily_within_its_window(codec, codec_target, drafter):
    """A sampled request still gets a greedy draft (a function of the prompt alone), and the
    drafter's window is cut to the positions it has."""
    recording = RecordingDrafter(drafter)
    engine = SpeculativeEngine(codec_target, codec, drafter=recording,
                               speculative=SpeculativeConfig(method="diffusion", drafter_tau=0.8))
    prompt = codec_prompts(codec, 1)[0]
    long_prompt = (prompt * 40)[:500]
    engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=1))])
    engine.generate([GenerationRequest(long_prompt, SamplingParams(max_tokens=20))])  # the target caps it at 12
    first, second = recording.requests
    assert first.sampling.temperature == 0 and first.sampling.max_tokens == 12 and first.options == {"tau": 0.8}
    assert second.sampling.max_tokens == drafter.model.config.max_position - 500 - 1


def test_a_drafted_answer_that_runs_out_hands_over_to_the_draft_model(codec, codec_target):
    """Rows with and without a drafted answer in one batch; once an answer is used up, the
    method's draft model proposes. Output: the target's, alone or batched."""
    ids = codec_prompts(codec, 3)
    reference = AutoregressiveEngine(codec_target, codec).generate(greedy_requests(ids, max_tokens=20))
    engine = SpeculativeEngine(codec_target, codec, draft=build_model(1, vocab_size=codec.vocab_size, num_layers=1),
                               speculative=SpeculativeConfig(method="draft", gamma=4, max_batch=4))
    requests = greedy_requests(ids, max_tokens=20)
    requests[0].draft_ids = reference[0].token_ids[:6]  # runs out after six tokens
    requests[2].draft_ids = reference[2].token_ids  # the whole answer
    done = engine.generate(requests)
    assert [c.token_ids for c in done] == [c.token_ids for c in reference]
    # the answer after the prefill's token (five accepted), then the model's proposals
    assert done[0].draft_forwards > 0 and done[0].draft_tokens_accepted >= 5
    assert done[1].draft_forwards > 0
