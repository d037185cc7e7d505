"""The reference decoders: greedy AR with the cache, LLaDA's one-token-per-forward schedule."""

from __future__ import annotations

import pytest
import torch

from nowait.engines.ar.engine import greedy_decode
from nowait.engines.diffusion.reference import commit_most_confident, reference_decode, window_logits

END_ID, MASK_ID = 0, 1


def naive_greedy(model, prompt: list[int], max_new_tokens: int, end_id: int) -> list[int]:
    """Recompute the full forward for every new token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token == end_id:
                break
            out.append(token)
            ids.append(token)
    return out


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (n,), generator=generator).tolist() for n in lengths]


def test_greedy_decode_equals_naive_loop(make_model):
    model = make_model(seed=3)
    prompts = prompts_of([3, 9, 6], seed=0)
    stats: dict = {}
    outputs = greedy_decode(model, prompts, max_new_tokens=12, end_id=END_ID, stats=stats)
    assert outputs == [naive_greedy(model, p, 12, END_ID) for p in prompts]
    assert all(len(o) == 12 for o in outputs)  # a random model never says END_ID here
    assert stats["forwards"] >= 12


def test_greedy_decode_rows_finish_at_different_times(make_model):
    model = make_model(seed=3)
    prompts = prompts_of([3, 9, 6], seed=0)
    free_run = naive_greedy(model, prompts[0], 12, end_id=-1)
    end_id = free_run[3]  # row 0 ends after three tokens; the others whenever they meet it
    expected = [naive_greedy(model, p, 12, end_id) for p in prompts]
    assert expected[0] == free_run[:3]
    assert max(len(e) for e in expected) > 3
    assert greedy_decode(model, prompts, max_new_tokens=12, end_id=end_id) == expected


def test_greedy_decode_stops_when_all_rows_end(make_model):
    model = make_model(seed=3)
    prompt = prompts_of([4], seed=1)[0]
    end_id = naive_greedy(model, prompt, 1, end_id=-1)[0]
    stats: dict = {}
    assert greedy_decode(model, [prompt, prompt], max_new_tokens=20, end_id=end_id, stats=stats) == [[], []]
    assert stats["forwards"] == 1  # the prefill alone


class RecordingModel:
    """Wraps a Transformer for reference_decode: counts forwards, keeps inputs and logits, and can
    push logits so that a random model never proposes the mask token (as a trained one does not)."""

    def __init__(self, model, bias: dict[int, float] | None = None) -> None:
        self.model, self.config = model, model.config
        self.bias = bias or {}
        self.inputs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def output_weight(self) -> torch.Tensor:
        return self.model.output_weight()

    def __call__(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        logits = self.model(ids, **kwargs).clone()
        for token, shift in self.bias.items():
            logits[..., token] += shift
        self.inputs.append(ids.clone())
        self.logits.append(logits)
        return logits


@pytest.mark.parametrize("shift", [False, True])
def test_reference_decode_commits_one_position_per_forward(make_model, shift):
    model = make_model(seed=4, causal=False, logits_shift=shift, mask_token_id=MASK_ID)
    recorder = RecordingModel(model, bias={MASK_ID: -1e4, END_ID: -1e4})
    prompts = prompts_of([5, 8, 3], seed=2)
    window, block = 8, 4
    stats: dict = {}
    outputs = reference_decode(recorder, prompts, window, block, MASK_ID, END_ID, stats=stats)
    assert stats["forwards"] == len(recorder.inputs) == window  # END never committed: both blocks run
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    positions = prompt_lengths[:, None] + torch.arange(window)
    rows = torch.arange(len(prompts))[:, None]
    for step, (ids, logits) in enumerate(zip(recorder.inputs, recorder.logits, strict=True)):
        answer = ids[rows, positions]
        masked = answer == MASK_ID
        assert masked.sum(1).tolist() == [window - step] * 3
        for row, prompt in enumerate(prompts):
            assert ids[row, : len(prompt)].tolist() == prompt
        after = (recorder.inputs[step + 1][rows, positions] if step + 1 < window
                 else torch.tensor(outputs))
        committed = masked & (after != MASK_ID)
        assert committed.sum(1).tolist() == [1, 1, 1]
        # The committed position is the most confident masked one of the current block.
        in_block = torch.zeros(window, dtype=torch.bool)
        in_block[(step // block) * block: (step // block + 1) * block] = True
        probabilities = window_logits(logits, prompt_lengths, window, shift).softmax(-1)
        confidence, prediction = probabilities.max(-1)
        for row in range(3):
            candidates = masked[row] & in_block
            best = int(confidence[row].masked_fill(~candidates, -1).argmax())
            assert committed[row].nonzero().flatten().tolist() == [best]
            assert int(after[row, best]) == int(prediction[row, best])
    assert all(len(o) == window and MASK_ID not in o and END_ID not in o for o in outputs)


def test_reference_decode_block_equal_to_window(make_model):
    model = make_model(seed=5, causal=False, mask_token_id=MASK_ID)
    recorder = RecordingModel(model, bias={MASK_ID: -1e4})
    stats: dict = {}
    outputs = reference_decode(recorder, prompts_of([6, 2], seed=3), 6, 6, MASK_ID, END_ID, stats=stats)
    assert stats["forwards"] <= 6
    assert all(MASK_ID not in o and END_ID not in o for o in outputs)


def test_reference_decode_stops_after_block_with_end(make_model):
    model = make_model(seed=6, causal=False, mask_token_id=MASK_ID)
    recorder = RecordingModel(model, bias={END_ID: 1e4})  # every position predicts END
    stats: dict = {}
    outputs = reference_decode(recorder, prompts_of([4, 7], seed=4), 12, 4, MASK_ID, END_ID, stats=stats)
    assert outputs == [[], []]
    assert stats["forwards"] == 4  # the first block only


def test_reference_decode_rejects_ragged_blocks(make_model):
    with pytest.raises(ValueError, match="multiple of block"):
        reference_decode(make_model(causal=False), [[2, 3]], 10, 4, MASK_ID, END_ID)


def test_commit_most_confident_picks_top_masked_only():
    confidence = torch.tensor([[0.9, 0.1, 0.5, 0.7, 0.2, 0.8],
                               [0.3, 0.6, 0.2, 0.4, 0.99, 0.1]])
    still_masked = torch.tensor([[False, True, True, True, True, False],
                                 [True, True, False, True, False, True]])
    chosen = commit_most_confident(confidence, still_masked, 2)
    assert chosen.tolist() == [[False, False, True, True, False, False],
                               [False, True, False, True, False, False]]
    # Asking for more than remain commits only what is still masked.
    few = torch.tensor([[False, False, False, False, True, False], [False] * 6])
    assert commit_most_confident(confidence, few, 3).tolist() == [[False, False, False, False, True, False],
                                                                  [False] * 6]
