"""`--profile`: a hand-made measurement file, fitted and used in place of the roofline."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nowait.planner.plan import make_plan, to_json
from nowait.planner.profile import (
    Measurement,
    ProfileError,
    fit_engine,
    fit_non_negative,
    fit_profile,
    identifiable_features,
    load_profile,
    step_features,
)
from nowait.planner.scenario import parse_scenario

SMALL = {  # a 1B model on 8xH100, one replica per accelerator; fixed lengths keep the arithmetic by hand
    "name": "small", "hardware": {"node": "8xH100-SXM"}, "model": "llama-3.2-1b",
    "workloads": [{"name": "chat", "arrival_rate_per_s": 5, "input_tokens": 200, "output_tokens": 50,
                   "p99_latency_s": 2, "token_value_usd_per_mtok": 1}],
    "simulation": {"requests": 300},
}

AR_TRUTH = (2e-3, 1e-5, 2e-8, 1e-10)  # per forward, per token, per cached token read, per attention pair
DIFFUSION_TRUTH = (3e-3, 2e-5, 0.0, 0.0)


def seconds(truth, batch, new_tokens, context):
    return float(step_features(new_tokens, context, batch) @ truth)


def write_profile(path, **engine_parameters):
    measurements = []
    for engine, truth, news in (("ar", AR_TRUTH, (1, 128)), ("diffusion", DIFFUSION_TRUTH, (32,))):
        for batch in (1, 4, 16):
            for new_tokens in news:
                for context in (0, 512, 2048):
                    measurements.append({"engine": engine, "batch": batch, "new_tokens": new_tokens,
                                         "context": context, "seconds": seconds(truth, batch, new_tokens, context)})
    profile = {"format": "nowait-profile/1", "model": "demo", "hardware": "laptop", "measured_at": "2025-06-01",
               "measurements": measurements, "engine_parameters": engine_parameters}
    path.write_text(json.dumps(profile))
    return path


def test_fit_recovers_the_coefficients_and_interpolates(tmp_path):
    fitted = fit_profile(load_profile(write_profile(tmp_path / "bench.json")))
    assert fitted["ar"].coefficients == pytest.approx(AR_TRUTH, rel=1e-6, abs=1e-15)
    assert fitted["diffusion"].coefficients == pytest.approx(DIFFUSION_TRUTH, rel=1e-6, abs=1e-12)
    assert fitted["ar"].worst_relative_error < 1e-6
    assert fitted["ar"](1, 1000, 8) == pytest.approx(seconds(AR_TRUTH, 8, 1, 1000), rel=1e-6)  # not measured


def test_a_time_cannot_fall_as_work_grows():
    features = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    assert list(fit_non_negative(features, np.array([3.0, 2.0, 1.0]))) == [2.0, 0.0]  # slope dropped, mean kept


def test_one_measurement_is_a_time_per_forward_whatever_the_shape():
    # One diffusion forward measured (95 new tokens over 180 cached): the planner's step model then
    # asks for 32-token forwards and whole-window refreshes, which must cost what was measured, not
    # what a minimum-norm fit on attention pairs would say (a third of it, and three times it).
    fitted = fit_engine("diffusion", [Measurement(engine="diffusion", batch=1, new_tokens=95, context=180,
                                                  seconds=0.02)])
    assert fitted.coefficients == (0.02, 0.0, 0.0, 0.0)
    assert fitted(32, 227, 1) == pytest.approx(0.02) and fitted(275, 0, 1) == pytest.approx(0.02)


def test_a_prefill_and_a_decode_step_give_a_time_per_forward_and_per_token():
    # A synchronous load test: a 161-token prefill in 45 ms and a decode step in 6 ms.
    rows = [Measurement(engine="ar", batch=1, new_tokens=161, context=0, seconds=0.045),
            Measurement(engine="ar", batch=1, new_tokens=1, context=218, seconds=0.006)]
    fitted = fit_engine("ar", rows)
    per_token = (0.045 - 0.006) / 160
    assert fitted.coefficients == pytest.approx((0.006 - per_token, per_token, 0.0, 0.0))
    assert fitted(1, 180, 1) == pytest.approx(0.006) and fitted(1, 260, 1) == pytest.approx(0.006)


def test_decode_steps_alone_cannot_separate_attention_from_tokens_and_cache_reads():
    # For one new token, attention pairs = tokens + cache reads: the fourth feature adds nothing.
    features = np.stack([step_features(1, context, batch) for batch, context in ((1, 200), (4, 300), (16, 250))])
    assert identifiable_features(features) == [0, 1, 2]
    assert identifiable_features(features[:1]) == [0]


def test_plan_uses_measured_step_times_and_engine_parameters(tmp_path):
    path = write_profile(tmp_path / "bench.json", diffusion={"tokens_per_forward": 8})
    plan = make_plan(parse_scenario(SMALL, "s.yaml"), load_profile(path))
    # 200 input + 50 output tokens: one AR step at the middle of the answer reads 225 cached tokens.
    step = seconds(AR_TRUTH, 1, 1, 225)
    assert to_json(plan)["workloads"][0]["engines"]["ar"]["single_stream_tokens_per_s"] == pytest.approx(
        1 / step, rel=1e-3)
    assert plan.fleets["diffusion"].make(1).tokens_per_forward == 8
    assert set(plan.fitted) == {"ar", "diffusion"}
    assert any("measured" in line for line in plan.assumptions)


def test_a_bad_profile_names_its_field(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"measurements": [{"engine": "ar", "batch": 1, "new_tokens": 1, "seconds": -1}]}))
    with pytest.raises(ProfileError, match=r"bench\.json: measurements\.0\.seconds: Input should be greater than 0"):
        load_profile(path)
    path.write_text(json.dumps({"measurements": [{"engine": "gpu", "batch": 1, "new_tokens": 1, "seconds": 1}]}))
    with pytest.raises(ProfileError, match=r"measurements\.0\.engine"):
        load_profile(path)
