"""The engine factory: each kind built from a config (the gateway YAML's engine models) on a real
checkpoint directory decodes exactly as the engine constructed by hand on the same weights, and a
config it cannot build is refused with a reason that names the problem."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nowait.checkpoints import CheckpointError, save_pretrained
from nowait.engines.ar import AutoregressiveEngine, EngineConfig, greedy_decode
from nowait.engines.base import GenerationRequest, SamplingParams
from nowait.engines.config import (
    ArEngineConfig,
    DiffusionEngineConfig,
    RemoteEngineConfig,
    SpecEngineConfig,
)
from nowait.engines.diffusion import DiffusionEngine, DiffusionOptions
from nowait.engines.factory import EngineConfigError, EngineModel, ModelCache, build_engine, engine_from
from nowait.engines.speculative import (
    SPEC_METHODS,
    IncompatibleDraftError,
    SpeculativeEngine,
    build_drafter,
)
from nowait.gateway.config import parse_config
from tests.conftest import build_model, swapped_codec

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["kyc", "loan"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def weights(codec):
    vocab = codec.vocab_size
    return {"ar": build_model(0, vocab_size=vocab), "draft": build_model(1, vocab_size=vocab, num_layers=1),
            "diffusion": build_model(2, vocab_size=vocab, causal=False, mask_token_id=codec.mask_id)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, codec, weights):
    root = tmp_path_factory.mktemp("factory")
    return {name: str(save_pretrained(model, codec, root / name)) for name, model in weights.items()}


@pytest.fixture(scope="module")
def prompts(codec):
    return [codec.encode("<|user|>Extract the KYC form\nname: Ada Lovelace\n<|assistant|>"),
            codec.encode("<|user|>Extract the loan\namount: 1200 EUR\n<|assistant|>")]


def outputs(engine, prompts, max_tokens: int = 12, schema: dict | None = None) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(
        [GenerationRequest(p, SamplingParams(max_tokens=max_tokens), schema=schema) for p in prompts])]


def test_an_ar_engine_from_its_config_decodes_as_the_engine_built_by_hand(codec, weights, checkpoints, prompts):
    built = build_engine(ArEngineConfig(kind="ar", model=checkpoints["ar"], max_num_seqs=2, structured=False),
                         name="batch")
    assert isinstance(built.engine, AutoregressiveEngine) and not isinstance(built.engine, SpeculativeEngine)
    assert built.engine.name == "batch" and str(built.target.path) == checkpoints["ar"]
    assert built.max_model_len == weights["ar"].config.max_position and built.engine.grammar is None
    by_hand = AutoregressiveEngine(weights["ar"], codec, EngineConfig(max_num_seqs=2))
    assert outputs(built.engine, prompts) == outputs(by_hand, prompts)
    # ...which is greedy decoding itself, stopped at the end token.
    greedy = greedy_decode(weights["ar"], prompts, 12, codec.end_id)
    assert outputs(built.engine, prompts) == greedy


def test_a_structured_ar_engine_constrains_as_the_hand_built_one(codec, weights, checkpoints, prompts):
    from nowait.engines.structured.grammar import GrammarCompiler

    built = build_engine(ArEngineConfig(kind="ar", model=checkpoints["ar"], max_num_seqs=2))  # structured: default
    assert built.engine.grammar is not None
    grammar = GrammarCompiler.from_codec(codec, vocab_size=weights["ar"].config.vocab_size)
    by_hand = AutoregressiveEngine(weights["ar"], codec, EngineConfig(max_num_seqs=2), grammar=grammar)
    constrained = outputs(built.engine, prompts, 40, SCHEMA)
    assert constrained == outputs(by_hand, prompts, 40, SCHEMA)
    assert constrained != outputs(built.engine, prompts, 40)  # the grammar did change the answer


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_each_speculative_method_from_its_config_decodes_as_built_by_hand(codec, weights, checkpoints, prompts,
                                                                           method):
    draft_name = "diffusion" if method == "diffusion" else "draft"
    config = SpecEngineConfig(kind="spec", model=checkpoints["ar"], draft=checkpoints[draft_name], method=method,
                              gamma=3, structured=False)
    built = build_engine(config)
    assert isinstance(built.engine, SpeculativeEngine)
    settings = built.engine.speculative
    assert settings.method == method and settings.gamma == 3
    uses_model = method != "ngram"
    assert (built.draft is not None) == uses_model
    engine_config = EngineConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=2048)
    if method == "diffusion":
        drafter = build_drafter(weights["diffusion"], codec, config.max_num_seqs)
        by_hand = SpeculativeEngine(weights["ar"], codec, engine_config, drafter=drafter, speculative=settings)
    else:
        by_hand = SpeculativeEngine(weights["ar"], codec, engine_config, speculative=settings,
                                    draft=weights["draft"] if uses_model else None,
                                    draft_codec=codec if uses_model else None)
    decoded = outputs(built.engine, prompts)
    assert decoded == outputs(by_hand, prompts)
    assert decoded == greedy_decode(weights["ar"], prompts, 12, codec.end_id)  # speculation keeps greedy output
    if uses_model:
        assert sum(c.draft_forwards for c in built.engine.generate(
            [GenerationRequest(prompts[0], SamplingParams(max_tokens=12))])) > 0  # the draft really drafted


def test_a_diffusion_engine_from_its_config_runs_its_options(codec, weights, checkpoints, prompts):
    config = DiffusionEngineConfig(kind="diffusion", model=checkpoints["diffusion"], max_batch=2,
                                   options={"block": 8, "cache": "prompt"})
    built = build_engine(config, name="fast")
    assert isinstance(built.engine, DiffusionEngine) and built.engine.name == "fast"
    assert built.engine.options.block == 8 and built.engine.options.cache == "prompt"
    assert built.engine.max_batch == 2 and built.max_model_len == weights["diffusion"].config.max_position
    options = DiffusionOptions(block=8, cache="prompt")
    by_hand = DiffusionEngine(weights["diffusion"], codec, options, max_batch=2)
    assert outputs(built.engine, prompts, 16) == outputs(by_hand, prompts, 16)
    # The same engine from options a caller already holds.
    again = engine_from(DiffusionEngineConfig.with_options(options, max_batch=2), EngineModel(weights["diffusion"],
                                                                                               codec))
    assert outputs(again, prompts, 16) == outputs(by_hand, prompts, 16)


def test_engines_naming_one_checkpoint_share_its_weights(checkpoints):
    models = ModelCache()
    ar = build_engine(ArEngineConfig(kind="ar", model=checkpoints["ar"], structured=False), models)
    spec = build_engine(SpecEngineConfig(kind="spec", model=checkpoints["ar"], method="ngram", structured=False),
                        models)
    assert ar.model is spec.model and len(models.loaded()) == 1


def test_the_gateway_yaml_engine_section_is_the_factory_input(checkpoints, tmp_path):
    config = parse_config({"engines": {
        "ar": {"kind": "ar", "model": checkpoints["ar"], "max_num_seqs": 3, "structured": False},
        "spec": {"kind": "spec", "model": checkpoints["ar"], "method": "ngram", "gamma": 2, "structured": False}},
        "routing": {"fast_engine": None}}, base=tmp_path)
    built = {name: build_engine(spec, name=name).engine for name, spec in config.engines.items()}
    assert built["ar"].config.max_num_seqs == 3 and built["spec"].speculative.gamma == 2


def test_configs_the_factory_cannot_build_are_refused_with_the_reason(codec, checkpoints, tmp_path):
    remote = RemoteEngineConfig(kind="remote", base_url="http://127.0.0.1:9/v1", model="m", input_usd_per_mtok=1,
                                output_usd_per_mtok=1)
    with pytest.raises(EngineConfigError, match="remote"):
        build_engine(remote)
    with pytest.raises(EngineConfigError, match=r"'ar' needs a causal \(AR\) model; .*diffusion.* is bidirectional"):
        build_engine(ArEngineConfig(kind="ar", model=checkpoints["diffusion"]))
    with pytest.raises(EngineConfigError, match="'diffusion' needs a bidirectional"):
        build_engine(DiffusionEngineConfig(kind="diffusion", model=checkpoints["ar"]))
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        build_engine(ArEngineConfig(kind="ar", model=str(tmp_path / "missing")))
    with pytest.raises(CheckpointError, match=r"^draft model: .*missing-draft"):
        build_engine(SpecEngineConfig(kind="spec", model=checkpoints["ar"], method="draft",
                                      draft=str(tmp_path / "missing-draft")))
    alien = save_pretrained(build_model(1, vocab_size=codec.vocab_size, num_layers=1), swapped_codec(codec),
                            tmp_path / "alien")
    with pytest.raises(IncompatibleDraftError, match="tokenizer"):
        build_engine(SpecEngineConfig(kind="spec", model=checkpoints["ar"], method="draft", draft=str(alien)))
    with pytest.raises(IncompatibleDraftError, match="needs a draft model"):  # in memory, no draft given
        engine_from(SpecEngineConfig(kind="spec", method="draft", structured=False),
                    EngineModel(build_model(0, vocab_size=codec.vocab_size), codec))
    with pytest.raises(ValidationError, match="max_num_seqs"):
        ArEngineConfig(kind="ar", max_num_seqs=0)
    with pytest.raises(ValidationError, match="unknown diffusion option"):
        DiffusionEngineConfig(kind="diffusion", options={"warp": 9})


def test_generate_runs_the_factory_engine_of_the_checkpoint_kind(codec, weights, checkpoints, prompts):
    from nowait.checkpoints import load_pretrained
    from nowait.engines.base import InvalidRequestError
    from nowait.generate import checkpoint_engine, generate_once

    ar = load_pretrained(checkpoints["ar"])
    engine = checkpoint_engine(ar, max_model_len=len(prompts[0]) + 12)
    assert isinstance(engine, AutoregressiveEngine) and engine.max_model_len == len(prompts[0]) + 12
    assert outputs(engine, prompts[:1]) == greedy_decode(weights["ar"], prompts[:1], 12, codec.end_id)
    diffusion = checkpoint_engine(load_pretrained(checkpoints["diffusion"]), max_batch=2)
    assert isinstance(diffusion, DiffusionEngine) and diffusion.max_batch == 2
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):  # one line, not a config error
        generate_once(ar, "", max_tokens=1, chat=False)
