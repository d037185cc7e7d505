"""DiffusionGemma's sampler against transformers' generate(): the same tokens for the same seed,
at the reference's default settings and at others; its small functions against the reference's."""

from __future__ import annotations

import json

import pytest
import torch

from nowait.engines.diffusion.gemma_sampler import (
    GemmaSampling,
    StabilityTracker,
    entropy_bound_accept,
    generate_diffusion_gemma,
    step_temperature,
    token_entropy,
)
from nowait.gemma_checkpoint import diffusion_gemma_config, load_diffusion_gemma

from .gemma_checkpoints import CANVAS, VOCAB, diffusion_gemma_checkpoint

pytest.importorskip("transformers.models.diffusion_gemma")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    directory = tmp_path_factory.mktemp("diffusiongemma-sampler")
    reference = diffusion_gemma_checkpoint(directory, seed=3)
    hf = json.loads((directory / "config.json").read_text())
    return reference, load_diffusion_gemma(directory, diffusion_gemma_config(hf), torch.float32, "cpu")


PROMPT = [17, 40, 5, 88, 23, 61, 9]


@pytest.mark.parametrize("settings", [
    {},  # the reference's defaults: 48 steps, entropy bound 0.1, temperatures 0.8 -> 0.4, adaptive stop
    {"max_denoising_steps": 6, "t_min": 0.5, "t_max": 1.5, "entropy_bound": 0.5},
    {"max_denoising_steps": 3, "stability_threshold": 0, "confidence_threshold": 1e9},  # stops after one step
])
def test_decode_equals_transformers_generate_token_for_token(gemma, settings):
    reference, ours = gemma
    torch.manual_seed(11)
    kwargs = {k: v for k, v in settings.items() if k != "entropy_bound"}
    if "entropy_bound" in settings:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=settings["entropy_bound"])
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=3 * CANVAS, eos_token_id=1,
                                  pad_token_id=0, **kwargs).sequences[0, len(PROMPT):].tolist()
    decode = generate_diffusion_gemma(ours, PROMPT, 3 * CANVAS, (1,), GemmaSampling(**settings),
                                      torch.Generator().manual_seed(11))
    assert decode.tokens == expected
    assert len(decode.blocks) == 3 and decode.finish_reason == "length"


def test_an_end_id_ends_the_answer_where_generate_pads(gemma):
    reference, ours = gemma
    sampling = GemmaSampling(max_denoising_steps=4)
    free = generate_diffusion_gemma(ours, PROMPT, 3 * CANVAS, (1,), sampling, torch.Generator().manual_seed(5))
    end = free.tokens[CANVAS + 2]  # a token of the second block becomes the end id
    torch.manual_seed(5)
    sequence = reference.generate(torch.tensor([PROMPT]), max_new_tokens=3 * CANVAS, eos_token_id=end,
                                  pad_token_id=0, max_denoising_steps=4).sequences[0, len(PROMPT):].tolist()
    decode = generate_diffusion_gemma(ours, PROMPT, 3 * CANVAS, (end,), sampling, torch.Generator().manual_seed(5))
    assert decode.finish_reason == "stop"
    assert decode.tokens == sequence[: sequence.index(end)]
    assert len(sequence) == CANVAS * len(decode.blocks)  # generate stopped after the same block


def test_small_functions_follow_the_reference():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
        EntropyBoundSamplerConfig,
        LinearTemperatureScheduleLogitsProcessor,
        StableAndConfidentStoppingCriteria,
    )

    logits = 4 * torch.randn(2, CANVAS, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, 3] = 0.0  # a flat row: the highest entropy
    logits[0, 5, 7] = 60.0  # a certain row: entropy ~0
    assert torch.allclose(token_entropy(logits), torch.distributions.Categorical(logits=logits).entropy())
    for bound in (1e-3, 0.1, 2.0, 50.0):
        sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), CANVAS, VOCAB, 8)
        sampler.accept_canvas(torch.zeros(2, CANVAS, dtype=torch.long), torch.ones(2, CANVAS, dtype=torch.long),
                              logits, 1)
        assert torch.equal(entropy_bound_accept(logits, bound), sampler.accepted_token_mask)
    accepted = entropy_bound_accept(logits, 1e-3)
    assert bool(accepted[0, 5]) and not bool(accepted[0, 3]) and int(accepted.sum(-1).min()) >= 1
    schedule = LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=10)
    for remaining in (10, 7, 1):
        assert torch.allclose(logits / step_temperature(remaining, 10, 0.4, 0.8), schedule(None, logits, remaining))
    stopper, ours = StableAndConfidentStoppingCriteria(1, 2.5), StabilityTracker(1, 2.5)
    for argmax in (logits.argmax(-1), logits.argmax(-1), torch.zeros(2, CANVAS, dtype=torch.long)):
        assert torch.equal(ours.done(argmax, logits), stopper(argmax, logits))


def test_sampling_reads_a_generation_config():
    sampling = GemmaSampling.from_generation_config({"max_denoising_steps": 12, "t_min": 0.1, "t_max": 0.9,
                                                     "sampler_config": {"entropy_bound": 0.3}})
    assert (sampling.max_denoising_steps, sampling.t_min, sampling.t_max, sampling.entropy_bound) == (12, 0.1, 0.9, 0.3)
    assert sampling.stability_threshold == GemmaSampling().stability_threshold
