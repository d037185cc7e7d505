"""One rule for completion tokens (docs/gateway.md, "Token counts"): the generated tokens, the end
token included when the model generated one, as vLLM and llama.cpp count them; a length limit's
end has no end token to count. `token_ids` and `text` never hold the end token."""

from __future__ import annotations

from nowait.engines.ar.engine import AutoregressiveEngine
from nowait.engines.base import Completion, GenerationRequest, SamplingParams
from tests.conftest import build_model

END = 0


def generate(engine: AutoregressiveEngine, prompt: list[int], max_tokens: int) -> Completion:
    request = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens))
    return engine.generate([request])[0]


def test_an_answer_ended_by_the_end_token_counts_it():
    model = build_model(4)
    prompt = [5, 9, 13, 2, 31]
    free = generate(AutoregressiveEngine(model, end_id=END), prompt, 10)
    assert free.finish_reason == "length" and not free.ended_by_end_token
    assert free.completion_tokens == len(free.token_ids) == 10
    end = free.token_ids[3]  # make the fourth generated token the model's end token
    stopped = generate(AutoregressiveEngine(model, end_id=end), prompt, 10)
    written = free.token_ids[: free.token_ids.index(end)]
    assert stopped.finish_reason == "stop" and stopped.token_ids == written and end not in stopped.token_ids
    assert stopped.ended_by_end_token and stopped.completion_tokens == len(written) + 1
    # Each counted token, the end one too, took one forward (the prefill gives the first).
    assert stopped.forwards == stopped.completion_tokens


def test_the_rule_reads_the_record_not_the_engine():
    plain = Completion(request_id="r", engine="x", token_ids=[4, 5], text="ab", finish_reason="stop", prompt_tokens=3)
    assert plain.completion_tokens == 2  # a stop string or a closed grammar: no end token generated
    ended = Completion(request_id="r", engine="x", token_ids=[4, 5], text="ab", finish_reason="stop",
                       prompt_tokens=3, ended_by_end_token=True)
    assert ended.completion_tokens == 3
    templated = Completion(request_id="r", engine="x", token_ids=[4, 5, 6], text="ab", finish_reason="stop",
                           prompt_tokens=3, text_tokens=2, ended_by_end_token=True)
    assert templated.completion_tokens == 3  # the text's tokens as the tokenizer writes them, then the end
