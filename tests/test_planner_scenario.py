"""Scenario files: the shipped example loads; each bad field gets one clear line naming it."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import yaml

from nowait.planner.hardware import Accelerator
from nowait.planner.scenario import LengthDistribution, ScenarioError, load_scenario, parse_scenario

BANK = Path(__file__).resolve().parents[1] / "examples" / "bank.yaml"

SMALL = {
    "name": "small",
    "hardware": {"node": "8xH100-SXM"},
    "model": "llama-3.2-1b",
    "workloads": [{"name": "chat", "arrival_rate_per_s": 5, "input_tokens": 200, "output_tokens": 50,
                   "p99_latency_s": 2, "token_value_usd_per_mtok": 1}],
    "simulation": {"requests": 300},
}


def error_for(data: dict, **kwargs) -> str:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data, "s.yaml", **kwargs)
    return str(caught.value)


def with_change(path: list, value) -> dict:
    data = copy.deepcopy(SMALL)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def test_the_bank_example_loads():
    scenario = load_scenario(BANK)
    assert [w.name for w in scenario.workloads] == ["overnight-kyc", "realtime-onboarding", "credit-memos"]
    assert scenario.node_usd_per_hour == 33.0
    assert scenario.workloads[0].rate_per_s == pytest.approx(1_000_000 / (8 * 3600))


@pytest.mark.parametrize(("path", "value", "expected"), [
    (["workloads", 0, "arrival_rate_per_s"], -3, "s.yaml: workloads[0] (chat).arrival_rate_per_s: must be greater "
                                                 "than 0 (got -3)"),
    (["hardware", "node"], "9xH900", "s.yaml: hardware.node: unknown node '9xH900'"),
    (["model"], "gpt-7", "s.yaml: model: unknown model preset 'gpt-7'"),
    (["workloads", 0, "data_class"], "secret", "s.yaml: workloads[0] (chat).data_class: must be 'public', "
                                               "'internal' or 'restricted'"),
    (["workloads", 0, "arival_rate"], 3, "s.yaml: workloads[0] (chat).arival_rate: unknown field"),
    (["tensor_parallel"], 3, "s.yaml: tensor_parallel: 3 does not divide the 8 accelerators of 8xH100-SXM"),
    (["engines"], {"diffusion": {"tokens_per_forward": 40}}, "s.yaml: engines.diffusion: tokens_per_forward (40) "
                                                             "cannot exceed block_width (32)"),
    (["apis"], [{"name": "x", "input_usd_per_mtok": 1, "output_usd_per_mtok": 2, "data_classes": ["restricted"]}],
     "s.yaml: apis[0].data_classes: restricted data never leaves"),
    (["workloads", 0, "output_tokens"], {"mean": 0}, "s.yaml: workloads[0] (chat).output_tokens.mean: must be "
                                                     "greater than 0"),
    (["dtype"], "fp8", None),  # H100 has fp8: accepted
])
def test_one_bad_field_gives_one_line_naming_it(path, value, expected):
    data = with_change(path, value)
    if expected is None:
        parse_scenario(data, "s.yaml")
        return
    message = error_for(data)
    assert message.startswith(expected), message
    assert "\n" not in message


def test_missing_model_and_missing_workloads():
    data = copy.deepcopy(SMALL)
    del data["model"]
    assert error_for(data) == "s.yaml: model: required field is missing"
    assert error_for(with_change(["workloads"], [])) == "s.yaml: workloads: needs at least 1 entry"


def test_a_rate_is_given_once():
    data = with_change(["workloads", 0, "requests"], 1000)
    assert "give arrival_rate_per_s, or requests with window_hours, not both" in error_for(data)


def test_a_node_without_a_reference_price_asks_for_one():
    message = error_for(with_change(["hardware", "node"], "8xH200-SXM"))
    assert message.startswith("s.yaml: hardware.price_usd_per_hour: 8xH200-SXM has no committed reference price")
    parse_scenario(with_change(["hardware"], {"node": "8xH200-SXM", "price_usd_per_hour": 40}), "s.yaml")


def test_host_needs_measuring_or_pasting():
    data = with_change(["hardware"], {"node": "host", "price_usd_per_hour": 0})
    assert "--measure-host" in error_for(data)
    host = Accelerator(name="host", peak_tflops={"bf16": 1.0}, memory_bandwidth_tb_s=0.05, memory_gb=16)
    assert parse_scenario(data, "s.yaml", host=host).accelerator.name == "host"
    pasted = {**data, "accelerators": [host.model_dump()]}
    assert parse_scenario(pasted, "s.yaml").node.accelerators == 1


def test_model_from_an_hf_config_file_relative_to_the_scenario(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(
        '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, '
        '"vocab_size": 100}')
    data = with_change(["model"], {"hf_config": "ckpt"})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    assert load_scenario(tmp_path / "s.yaml").model.spec.shape.hidden_size == 64
    broken = with_change(["model"], {"config": {"hidden_size": 64}})
    assert error_for(broken).startswith("s.yaml: model: config of 'inline model' has no 'vocab_size'")


def test_unreadable_files(tmp_path):
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("workloads: [unclosed")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(tmp_path / "bad.yaml")


def test_length_distributions_have_the_stated_mean():
    rng = np.random.default_rng(0)
    for kind in ("lognormal", "normal", "uniform", "exponential"):
        lengths = LengthDistribution(distribution=kind, mean=400, sd=100).sample(20_000, rng)
        assert lengths.mean() == pytest.approx(400, rel=0.03), kind
        assert lengths.min() >= 1
    assert (LengthDistribution.model_validate(120).sample(3, rng) == 120).all()
