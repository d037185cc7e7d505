"""Sampling policies: greedy, temperature, top-k, top-p, seeded draws, and bad parameters."""

from __future__ import annotations

import pytest
import torch

from nowait.engines.ar.sampling import (
    SamplingBatch,
    apply_temperature,
    choose_tokens,
    sample_from,
    sampling_distribution,
    token_probability,
    truncate_top_k_top_p,
)
from nowait.engines.base import InvalidRequestError, SamplingParams


def batch_of(*params: SamplingParams) -> SamplingBatch:
    return SamplingBatch.from_params(list(params))


def test_greedy_rows_are_one_hot_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    probs = sampling_distribution(logits, batch_of(SamplingParams(), SamplingParams()))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert choose_tokens(logits, batch_of(SamplingParams(), SamplingParams()), [None, None]).tolist() == [1, 0]


def test_temperature_scales_the_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    probs = sampling_distribution(logits, batch_of(SamplingParams(temperature=2.0)))
    assert torch.allclose(probs, (logits / 2).softmax(-1))
    # Shifted by the row's maximum (the same softmax), so a tiny temperature cannot overflow.
    assert torch.allclose(apply_temperature(logits, torch.tensor([0.5])), (logits - 4.0) * 2)


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    kept = truncate_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept).nonzero()[:, 1].tolist() == [1, 3]
    probs = sampling_distribution(logits, batch_of(SamplingParams(temperature=1.0, top_k=1)))
    assert probs.argmax().item() == 1 and probs.max().item() == pytest.approx(1.0)


@pytest.mark.parametrize(("top_p", "support"), [(0.5, [0]), (0.51, [0, 1]), (0.8, [0, 1]), (0.81, [0, 1, 2]),
                                                (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_nucleus(top_p, support):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = sampling_distribution(probs.log(), batch_of(SamplingParams(temperature=1.0, top_p=top_p)))
    assert (kept[0] > 0).nonzero().flatten().tolist() == support
    assert kept.sum().item() == pytest.approx(1.0)


def test_rows_keep_their_own_parameters():
    logits = torch.tensor([[0.0, 1.0, 2.0]] * 3)
    probs = sampling_distribution(logits, batch_of(SamplingParams(), SamplingParams(temperature=1.0),
                                                   SamplingParams(temperature=1.0, top_k=2)))
    assert probs[0].tolist() == [0.0, 0.0, 1.0]
    assert torch.allclose(probs[1], logits[1].softmax(-1))
    assert probs[2, 0] == 0 and probs[2, 1:].sum().item() == pytest.approx(1.0)


def test_inverse_cdf_draws_follow_the_distribution_and_skip_zero_mass():
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3])
    uniforms = torch.rand(40000, generator=torch.Generator().manual_seed(0))
    tokens = sample_from(probs.expand(40000, -1), uniforms)
    frequencies = torch.bincount(tokens, minlength=4).float() / 40000
    assert frequencies[1] == 0
    assert torch.allclose(frequencies, probs, atol=0.01)
    assert sample_from(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0.999999])).item() == 1


def test_seeded_draws_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.9)

    def draw(rows: list[int]) -> list[int]:
        generators = [torch.Generator().manual_seed(100 + r) for r in rows]
        return choose_tokens(logits[rows], batch_of(*[params] * len(rows)), generators).tolist()

    together = draw([0, 1, 2])
    assert [draw([r])[0] for r in range(3)] == together


def test_confidence_is_the_models_own_probability():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    assert token_probability(logits, torch.tensor([2])).item() == pytest.approx(logits.softmax(-1)[0, 2].item())


@pytest.mark.parametrize(("params", "name"), [
    (SamplingParams(max_tokens=-1), "max_tokens"), (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(top_p=0.0), "top_p"), (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(temperature=-0.1), "temperature"), (SamplingParams(top_k=-2), "top_k"),
])
def test_bad_parameters_name_themselves(params, name):
    with pytest.raises(InvalidRequestError, match=name):
        params.validate()


def test_top_p_of_one_keeps_every_token():
    """In float32 the running mass of a large peaked vocabulary reaches 1 before its last tokens;
    top_p = 1 must still cut nothing."""
    logits = torch.randn(2, 32000, generator=torch.Generator().manual_seed(0)) * 3
    kept = truncate_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(kept).all()


def test_a_tiny_temperature_is_the_argmax_not_nan():
    from nowait.engines.diffusion.policies import propose_tokens

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 5
    probs = sampling_distribution(logits, batch_of(*[SamplingParams(temperature=1e-40)] * 3))
    assert not probs.isnan().any() and torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.allclose(probs.max(-1).values, torch.ones(3))
    noise = torch.rand(3, 50, dtype=torch.float64)
    assert torch.equal(propose_tokens(logits, 1e-300, noise), logits.argmax(-1))
