"""The sampling and acceptance functions on another device's tensors, checked without a GPU.

The engines make some tensors on the host (sampling parameters, uniforms from each request's
generator, speculative proposals and counts) and meet the model's logits with them. On a DEVICE
device a host tensor there is an error at the first sampled request, which no CPU run shows.
PyTorch's `meta` device holds shapes and no data, and its elementwise kernels refuse a CPU
operand as DEVICE's do, so these run the pure functions on `meta` logits with the host tensors the
engines pass. (FakeTensorMode's fake DEVICE tensors would check every operation, but slicing one
needs a DEVICE build.)"""

from __future__ import annotations

import pytest
import torch

from nowait.engines.ar.sampling import SamplingBatch, sample_from, sampling_distribution, token_probability
from nowait.engines.base import SamplingParams
from nowait.engines.speculative.acceptance import proposal_distributions, speculative_accept
from nowait.engines.speculative.engine import last_logits

DEVICE = torch.device("meta")  # stands for the GPU
VOCAB = 11


def test_the_meta_device_refuses_host_operands_as_a_gpu_does():
    """Without this the tests below could not fail."""
    host = torch.ones(3)
    with pytest.raises(RuntimeError, match="not on the expected device"):
        torch.zeros(3, device=DEVICE) + host
    with pytest.raises(RuntimeError, match="not on the expected device"):
        torch.where(host > 0, torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE))


def test_sampling_with_host_parameters_on_device_logits():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
    batch = SamplingBatch.from_params(params)  # on the host, as a caller that names no device makes it
    uniforms = torch.tensor([0.5, 0.25])
    logits = torch.randn(2, VOCAB, device=DEVICE)
    probs = sampling_distribution(logits, batch)
    tokens = sample_from(probs, uniforms)
    confidence = token_probability(logits, tokens)
    assert probs.device == tokens.device == confidence.device == DEVICE
    assert probs.shape == (2, VOCAB) and tokens.shape == (2,)


def test_on_moves_only_when_needed():
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.5)])
    assert batch.on("cpu") is batch
    moved = batch.on(DEVICE)
    assert moved.temperature.device == moved.top_k.device == moved.top_p.device == DEVICE


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_speculative_acceptance_with_host_proposals(with_draft_probs):
    draft_tokens = torch.tensor([[3, 4, 0], [5, 0, 0]])  # padded past each row's count
    counts = torch.tensor([2, 1])
    accept_uniforms, sample_uniforms = torch.full((2, 3), 0.5), torch.full((2,), 0.5)
    target_probs = torch.rand(2, 4, VOCAB, device=DEVICE).softmax(-1)
    draft_probs = torch.rand(2, 3, VOCAB, device=DEVICE).softmax(-1) if with_draft_probs else None
    accepted, next_tokens = speculative_accept(draft_tokens, counts, target_probs, draft_probs,
                                               accept_uniforms, sample_uniforms)
    none_proposed = speculative_accept(torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]),
                                       target_probs[:, :1], None, torch.zeros(2, 0), sample_uniforms)
    assert accepted.device == next_tokens.device == DEVICE
    assert none_proposed[0].device == none_proposed[1].device == DEVICE


def test_proposal_distributions_and_last_logits_stay_on_the_device():
    draft_probs = torch.rand(2, 2, VOCAB, device=DEVICE)
    # Row 0: two drafted proposals then a looked-up one (a point mass); row 1: one drafted.
    q = proposal_distributions([[1, 2, 3], [4]], [2, 1], draft_probs)
    logits = torch.randn(2, 4, VOCAB, device=DEVICE)
    ragged = last_logits(logits, [4, 2])
    whole = last_logits(logits, [4, 4])
    assert q.device == ragged.device == whole.device == DEVICE
    assert q.shape == (2, 3, VOCAB) and ragged.shape == whole.shape == (2, VOCAB)
