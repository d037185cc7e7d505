"""`bench load --profile-out`: load-test records -> the planner's measured profile (nowait-profile/1).

The planner wants the seconds of single forwards (docs/planner.md, "Measured profiles"); a load
test sees requests. Each measurement below is read off the requests of one run, for one engine,
using the engine's own structure:

    AR prefill    synchronous run: batch 1, new_tokens = median prompt, context 0,
                  seconds = median TTFT (the prefill forward emits the first token)
    AR decode     every streamed run: batch = the engine's mean concurrency in the run (Little's
                  law), new_tokens 1, context = mean prompt + half the mean answer,
                  seconds = median inter-token latency (one decode step per token), less the
                  other requests' prefills that stalled it (`interleaved_prefills`)
    diffusion     every run whose answers say their forwards (the nowait gateway's
                  `engines_tried[].forwards`, or the engine in process): batch = mean
                  concurrency, new_tokens = mean answer tokens, context = mean prompt,
                  seconds = median of (engine seconds / the planner's forwards, see
                  `planner_forwards`)
    parameters    diffusion tokens_per_forward = answer tokens / decoding forwards over all
                  runs (the planner counts the prompt's prefill apart);
                  fallback_rate = share of diffusion answers the gateway re-ran

These are upper bounds on a forward's time (queueing, HTTP and interleaved prefills land in the
request timings), which is what a capacity plan should be conservative about. A speculative
engine's step is a draft run plus a verify forward, not one forward, so `spec` answers are not
written; nor are remote upstreams' (their hardware is not ours). An OpenAI-compatible server that
says nothing about its engines (vLLM, SGLang) is taken to serve an AR model (`--profile-engine`).
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nowait.bench.load_metrics import RequestRecord
from nowait.bench.load_runner import RunResult
from nowait.planner.profile import DiffusionParameters, EngineParameters, Measurement, Profile


class ProfileWriteError(ValueError):
    """Nothing in the run can become a measurement (one clear line)."""


def _median(values: list[float]) -> float:
    return float(np.median(values))


def _engine_records(result: RunResult) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in result.records:
        if record.ok:
            groups[record.engine or record.target].append(record)
    return groups


def _mean_concurrency(records: list[RequestRecord], duration_s: float) -> float:
    return sum(r.e2e_s for r in records) / duration_s if duration_s > 0 else 1.0


def _concurrency(records: list[RequestRecord], duration_s: float) -> int:
    return max(1, round(_mean_concurrency(records, duration_s)))


def _streamed(records: list[RequestRecord]) -> list[RequestRecord]:
    # Only answers from a single engine run: a fallback's timings mix two engines.
    return [r for r in records if len(r.attempts) <= 1 and r.itl_s is not None and r.first_token_s is not None
            and r.first_token_s < r.done_s]


def interleaved_prefills(mode: str, concurrency: float, decode_share: float) -> float:
    """Other requests' prompts prefilled while one request decodes, on average.

    An AR engine stops its running batch to prefill each newcomer (vLLM's schedule, and the
    nowait engine's), so those prefills land in the inter-token gaps; the planner charges them
    apart. Over a request's life the other requests arrive at (concurrency - 1) per lifetime with
    a fixed number of streams (its own next request comes after it), at the whole concurrency per
    lifetime in an open-loop Poisson run; `decode_share` (decode span / e2e) keeps the part of
    the life after the first token.
    """
    others = concurrency if mode == "poisson" else concurrency - 1
    return max(0.0, others) * decode_share


def decode_step_seconds(itl_s: float, prefills: float, prefill_s: float, output_tokens: float,
                        floor_s: float) -> float:
    """One decode step's time: the inter-token latency less the interleaved prefills spread over
    the answer's gaps, never below `floor_s` (the step measured alone: batching adds work)."""
    gaps = max(output_tokens - 1, 1.0)
    return max(floor_s, itl_s - prefills * prefill_s / gaps)


def _ar_prefill(streamed: list[RequestRecord]) -> Measurement:
    """The time to first token as a prefill: of the prompt's tokens, those a prefix cache restored
    (as the server's usage reports them) are context the computed ones attend to, not work."""
    computed = _median([r.prompt_tokens - r.cached_prompt_tokens for r in streamed])
    return Measurement(engine="ar", batch=1, new_tokens=max(1, round(computed)),
                       context=round(_median([r.cached_prompt_tokens for r in streamed])),
                       seconds=_median([r.ttft_s for r in streamed]))


def _ar_measurements(result: RunResult, streamed: list[RequestRecord], duration_s: float,
                     alone: tuple[float, float] | None) -> list[Measurement]:
    """`alone`: (prefill seconds, decode step seconds) of this engine's synchronous run, if any."""
    if not streamed:
        return []
    prompt = float(np.mean([r.prompt_tokens for r in streamed]))
    answer = float(np.mean([r.output_tokens for r in streamed]))
    out = []
    if result.spec.mode == "synchronous" and prompt >= 1:
        out.append(_ar_prefill(streamed))
    itl = _median([r.itl_s for r in streamed])
    if result.spec.mode != "synchronous" and alone is not None:
        share = float(np.mean([(r.e2e_s - r.ttft_s) / r.e2e_s for r in streamed if r.e2e_s > 0]))
        prefills = interleaved_prefills(result.spec.mode, _mean_concurrency(streamed, duration_s), share)
        itl = decode_step_seconds(itl, prefills, alone[0], answer, floor_s=alone[1])
    if itl > 0:
        out.append(Measurement(engine="ar", batch=_concurrency(streamed, duration_s), new_tokens=1,
                               context=round(prompt + answer / 2), seconds=itl))
    return out


def _run_duration(result: RunResult) -> float:
    if not result.records:
        return 0.0
    return max(r.done_s for r in result.records) - min(r.sent_s for r in result.records)


def _alone(results: list[RunResult], kind_of: Callable[[str], str | None],
           default_kind: str) -> dict[str, tuple[float, float]]:
    """Per AR engine, (prefill seconds, decode step seconds) measured in its synchronous runs."""
    streamed: dict[str, list[RequestRecord]] = defaultdict(list)
    for result in results:
        if result.spec.mode != "synchronous":
            continue
        for engine, records in _engine_records(result).items():
            if (kind_of(engine) or default_kind) == "ar":
                streamed[engine] += _streamed(records)
    return {engine: (_ar_prefill(records).seconds, _median([r.itl_s for r in records]))
            for engine, records in streamed.items() if records}


def _diffusion_runs(records: list[RequestRecord], engine: str) -> list[tuple[RequestRecord, float, int, int]]:
    """(record, engine seconds, forwards, answer tokens) of each diffusion run that says its forwards."""
    runs = []
    for record in records:
        for attempt in record.attempts:
            if attempt.engine == engine and attempt.forwards and attempt.seconds > 0:
                runs.append((record, attempt.seconds, attempt.forwards, attempt.completion_tokens))
    return runs


def planner_forwards(forwards: int, alone: bool) -> tuple[int, int]:
    """(decoding forwards, forwards as the planner counts them) of one nowait diffusion answer.

    The planner prices a request as a prefill forward plus the decoding forwards that
    `tokens_per_forward` is about. The engine's count differs by how the prompt went in: a
    request alone (every request of a synchronous run) forwards its prompt with its window's
    first refresh, so all its forwards decode, and the planner's prefill is one more; a request
    that joined a batch had its prompt prefilled in a forward of its own, already counted.
    Either way the planner's forwards, times the measured seconds per forward, give the
    answer's time back."""
    if alone:
        return forwards, forwards + 1
    decoding = forwards - 1 if forwards > 1 else forwards
    return decoding, decoding + 1


def build_profile(results: list[RunResult], kind_of: Callable[[str], str | None], model: str, hardware: str,
                  default_kind: str = "ar") -> tuple[Profile, list[str]]:
    """The planner profile of a load test, and notes on what was left out and why."""
    measurements: list[Measurement] = []
    notes: list[str] = []
    tokens = forwards = 0
    fast_answers = fell_back = 0
    alone = _alone(results, kind_of, default_kind)
    for result in results:
        answered = [r for r in result.records if r.ok]
        duration = _run_duration(result)
        for engine, records in _engine_records(result).items():
            kind = kind_of(engine) or default_kind
            if kind == "ar":
                streamed = _streamed(records)
                measurements += _ar_measurements(result, streamed, duration, alone.get(engine))
                batched = streamed and _concurrency(streamed, duration) > 1
                if batched and result.spec.mode != "synchronous" and engine not in alone:
                    note = (f"{engine}: no synchronous run, so its batched decode steps keep the prefills "
                            "interleaved with them (upper bounds); add one (--profile sweep starts with it)")
                    if note not in notes:
                        notes.append(note)
            elif kind not in ("diffusion", "router"):
                note = f"{engine} ({kind}): not written, " + (
                    "a speculative step is a draft run plus a verify forward, not one forward" if kind == "spec"
                    else "its hardware is not ours" if kind == "remote" else "no forward structure known")
                if note not in notes:
                    notes.append(note)
        # Diffusion runs are read from the attempts, so an answer that fell back to AR still
        # contributes its diffusion run (its forwards were spent all the same).
        diffusion_engines = {a.engine for r in answered for a in r.attempts
                             if (kind_of(a.engine) or default_kind) == "diffusion"}
        for engine in sorted(diffusion_engines):
            runs = _diffusion_runs(answered, engine)
            if not runs:
                continue
            one_at_a_time = result.spec.mode == "synchronous"
            counted = [planner_forwards(f, one_at_a_time) for _, _, f, _ in runs]
            measurements.append(Measurement(
                engine="diffusion", batch=_concurrency([r for r, *_ in runs], duration),
                new_tokens=max(1, round(float(np.mean([t for *_, t in runs])))),
                context=round(float(np.mean([r.prompt_tokens for r, *_ in runs]))),
                seconds=_median([s / total for (_, s, _, _), (_, total) in zip(runs, counted, strict=True)])))
            tokens += sum(t for *_, t in runs)
            forwards += sum(decoding for decoding, _ in counted)
        for record in answered:  # the fallback share of answers the router sent to diffusion first
            if record.attempts and record.rule is not None and kind_of(record.attempts[0].engine) == "diffusion":
                fast_answers += 1
                fell_back += record.fallback
    if not measurements:
        raise ProfileWriteError("no measurement could be derived from this run for the planner: it needs streamed "
                                "answers from an AR engine, or diffusion answers that report their forwards")
    diffusion = DiffusionParameters(
        tokens_per_forward=round(tokens / forwards, 4) if forwards else None,
        fallback_rate=round(fell_back / fast_answers, 4) if fast_answers else None)
    profile = Profile(model=model, hardware=hardware, measured_at=datetime.date.today().isoformat(),
                      measurements=measurements, engine_parameters=EngineParameters(diffusion=diffusion))
    return profile, notes


def write_profile(profile: Profile, path: str | Path) -> Path:
    """The profile as the JSON `nowait plan --profile` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path
