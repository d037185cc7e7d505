"""bench load's planner profile: written from hand-made runs, read back by the planner."""

from __future__ import annotations

import pytest

from nowait.bench.load_metrics import EngineRun, RequestRecord
from nowait.bench.load_profile_out import (
    ProfileWriteError,
    build_profile,
    decode_step_seconds,
    interleaved_prefills,
    planner_forwards,
    write_profile,
)
from nowait.bench.load_runner import RunResult, RunSpec
from nowait.planner.profile import PROFILE_FORMAT, fit_profile, load_profile

KINDS = {"ar": "ar", "diffusion": "diffusion", "spec": "spec", "nowait": "router"}


def ar_record(sent: float, ttft: float, itl: float, tokens: int = 11, prompt: int = 200) -> RequestRecord:
    return RequestRecord(target="ar", engine="ar", sent_s=sent, first_token_s=sent + ttft,
                         done_s=sent + ttft + itl * (tokens - 1), prompt_tokens=prompt, output_tokens=tokens,
                         attempts=(EngineRun("ar", ttft + itl * (tokens - 1), prompt, tokens, forwards=tokens),))


def diffusion_record(sent: float, seconds: float, forwards: int, fallback: bool = False) -> RequestRecord:
    attempts = (EngineRun("diffusion", seconds, 180, 120, forwards=forwards),)
    if fallback:
        attempts += (EngineRun("ar", 0.5, 180, 100, forwards=100),)
    return RequestRecord(target="nowait", engine="ar" if fallback else "diffusion", rule="fast", fallback=fallback,
                         sent_s=sent, first_token_s=sent + seconds, done_s=sent + seconds, prompt_tokens=180,
                         output_tokens=120, attempts=attempts)


def runs() -> list[RunResult]:
    synchronous = RunResult("ar", "ar", RunSpec("synchronous"),
                            [ar_record(i * 1.0, ttft=0.05, itl=0.01) for i in range(5)])
    # Four streams, each request 0.15 s, back to back over 0.6 s: four in flight on average.
    concurrent = RunResult("ar", "ar", RunSpec("concurrent", 4.0),
                           [ar_record(0.15 * (i // 4), ttft=0.05, itl=0.01) for i in range(16)])
    fast = RunResult("nowait", "router", RunSpec("synchronous"),
                     [diffusion_record(0.0, 0.2, 10), diffusion_record(0.2, 0.2, 10),
                      diffusion_record(0.4, 0.2, 10), diffusion_record(0.6, 0.2, 10, fallback=True)])
    return [synchronous, concurrent, fast]


def test_measurements_follow_the_engines_structure():
    profile, notes = build_profile(runs(), KINDS.get, model="demo", hardware="test box")
    ar = [m for m in profile.measurements if m.engine == "ar"]
    prefill = [m for m in ar if m.new_tokens > 1]
    decode = sorted((m for m in ar if m.new_tokens == 1), key=lambda m: m.batch)
    assert len(prefill) == 1 and prefill[0].batch == 1 and prefill[0].context == 0
    assert prefill[0].new_tokens == 200 and prefill[0].seconds == pytest.approx(0.05)
    assert [m.batch for m in decode] == [1, 4]
    assert all(m.seconds == pytest.approx(0.01) and m.context == round(200 + 11 / 2) for m in decode)
    [diffusion] = [m for m in profile.measurements if m.engine == "diffusion"]
    # Alone, each answer's 10 forwards all decode (the prompt rode in the first): the planner
    # counts 11 with its prefill, so 0.2 s is 11 forwards of 0.2 / 11 s.
    assert diffusion.seconds == pytest.approx(0.2 / 11)
    assert (diffusion.new_tokens, diffusion.context) == (120, 180)
    assert profile.engine_parameters.diffusion.tokens_per_forward == pytest.approx(480 / 40, abs=1e-4)
    assert profile.engine_parameters.diffusion.fallback_rate == pytest.approx(0.25)
    assert notes == []


def test_a_prefix_cache_hit_makes_the_prefill_the_prompts_rest_over_a_cached_context():
    """The time to first token computed only the prompt's uncached tokens: 150 of 200 restored
    (as usage reported them) is a 50-token prefill over 150 cached, not a 200-token one."""
    from dataclasses import replace

    records = [replace(ar_record(i * 1.0, ttft=0.02, itl=0.01), cached_prompt_tokens=150) for i in range(5)]
    profile, _ = build_profile([RunResult("ar", "ar", RunSpec("synchronous"), records)], KINDS.get, "demo", "box")
    [prefill] = [m for m in profile.measurements if m.engine == "ar" and m.new_tokens > 1]
    assert (prefill.new_tokens, prefill.context, prefill.seconds) == (50, 150, pytest.approx(0.02))


def test_cached_tokens_are_read_from_usage_as_openai_writes_them():
    from nowait.bench.load_http import cached_tokens
    from nowait.bench.load_metrics import summarize_run

    assert cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}}) == 8
    assert cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": None}) == 0
    assert cached_tokens({"prompt_tokens_details": "odd"}) == 0 and cached_tokens(None) == 0
    from dataclasses import replace

    records = [replace(ar_record(0.0, 0.02, 0.01), cached_prompt_tokens=c) for c in (0, 16, 32)]
    assert summarize_run(records).mean_cached_prompt_tokens == 16


def test_profile_round_trips_into_the_planner(tmp_path):
    profile, _ = build_profile(runs(), KINDS.get, model="demo", hardware="test box")
    path = write_profile(profile, tmp_path / "sub" / "bench.json")
    loaded = load_profile(path)
    assert loaded.format == PROFILE_FORMAT and loaded.hardware == "test box"
    assert loaded.measurements == profile.measurements
    fitted = fit_profile(loaded)
    assert set(fitted) == {"ar", "diffusion"}
    # The fit reproduces the decode step it was given (same context, batch 1).
    assert fitted["ar"](1, 205, 1) == pytest.approx(0.01, rel=0.5)


def test_speculative_and_unknown_answers_are_not_written_and_say_why():
    spec_run = RunResult("spec", "spec", RunSpec("synchronous"),
                         [RequestRecord("spec", 0.0, 0.5, 0.1, 100, 10, engine="spec")])
    with pytest.raises(ProfileWriteError, match="no measurement"):
        build_profile([spec_run], KINDS.get, model="m", hardware="h")
    profile, notes = build_profile([*runs(), spec_run], KINDS.get, model="m", hardware="h")
    assert any(note.startswith("spec (spec)") for note in notes)
    # A server that says nothing about its engines is taken as AR (vLLM, SGLang) unless told otherwise.
    plain = RunResult("llama", None, RunSpec("synchronous"),
                      [RequestRecord("llama", 0.0, 0.3, 0.1, 100, 11) for _ in range(3)])
    profile, _ = build_profile([plain], lambda name: None, model="llama", hardware="h")
    assert {m.engine for m in profile.measurements} == {"ar"}


def test_interleaved_prefills_by_hand():
    # Four streams: three other requests start during one request's life, 3/4 of it after its first token.
    assert interleaved_prefills("concurrent", 4.0, 0.75) == pytest.approx(2.25)
    # Open loop: arrivals do not wait for this request, so the whole concurrency counts.
    assert interleaved_prefills("poisson", 2.0, 0.5) == pytest.approx(1.0)
    assert interleaved_prefills("synchronous", 0.98, 0.9) == 0.0  # alone: nothing interleaves
    # 20 ms between tokens, two 50 ms prefills spread over 10 gaps: 10 ms of decoding per token.
    assert decode_step_seconds(0.02, 2.0, 0.05, 11, floor_s=0.005) == pytest.approx(0.01)
    assert decode_step_seconds(0.02, 2.0, 0.05, 11, floor_s=0.015) == pytest.approx(0.015)  # batching adds work


def test_batched_decode_steps_leave_out_the_prefills_that_stalled_them():
    alone = RunResult("ar", "ar", RunSpec("synchronous"), [ar_record(i * 1.0, ttft=0.05, itl=0.005) for i in range(3)])
    # Four streams back to back, each request 0.25 s (50 ms to the first token, 20 ms gaps): four
    # in flight, 80% of each life decoding, so 3 x 0.8 = 2.4 prefills of 50 ms in its 10 gaps.
    busy = RunResult("ar", "ar", RunSpec("concurrent", 4.0),
                     [ar_record(0.25 * (i // 4), ttft=0.05, itl=0.02) for i in range(16)])
    profile, notes = build_profile([alone, busy], KINDS.get, model="demo", hardware="h")
    [batched] = [m for m in profile.measurements if m.batch == 4]
    assert batched.seconds == pytest.approx(0.02 - 2.4 * 0.05 / 10)
    assert notes == []
    # Without a synchronous run there is no prefill time to take off: the step stays an upper bound, said so.
    profile, notes = build_profile([busy], KINDS.get, model="demo", hardware="h")
    assert [m.seconds for m in profile.measurements] == [pytest.approx(0.02)]
    assert any("no synchronous run" in note for note in notes)


def test_the_planner_counts_a_diffusion_answers_prefill_apart():
    # Alone, the prompt rode in the first forward: every forward decodes, the planner adds its prefill.
    assert [planner_forwards(f, alone=True) for f in (10, 2, 1)] == [(10, 11), (2, 3), (1, 2)]
    # Joined a batch: the prompt's own prefill forward is in the count already.
    assert [planner_forwards(f, alone=False) for f in (10, 2, 1)] == [(9, 10), (1, 2), (1, 2)]
