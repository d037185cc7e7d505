"""Real checkpoint layouts: Llama, Qwen2, LLaDA, Dream, loaded by nowait and held against transformers.

Every checkpoint is tiny, random and built in the test (tests/hf_checkpoints.py): Llama and Qwen2
with transformers' own classes, LLaDA and Dream in their published layouts from the weights of a
transformers model that then serves as the reference, run without its causal mask.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from nowait.checkpoint_files import tensor_names, weight_files
from nowait.checkpoints import CheckpointError, load_pretrained
from nowait.conventions import apply_chat_template, encode_prompt
from nowait.engines.diffusion.reference import window_logits
from nowait.generate import generate_once
from nowait.model import KVCache

from .hf_checkpoints import (
    bidirectional_logits,
    causal_logits,
    dream_checkpoint,
    hf_llama,
    hf_qwen2,
    llada_checkpoint,
    sample_ids,
    save_hf,
    token_id,
    write_weights,
)

transformers = pytest.importorskip("transformers")

TOLERANCE = dict(atol=1e-4, rtol=1e-4)
AR_CASES = {
    "llama": lambda: hf_llama(1),
    "llama_tied_mha": lambda: hf_llama(2, tie_word_embeddings=True, num_key_value_heads=4),
    # Llama 3.1's RoPE scaling; a short original context so the scaling moves every band here.
    "llama31_rope": lambda: hf_llama(3, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                         "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}),
    "qwen2": lambda: hf_qwen2(4),
    "qwen2_untied": lambda: hf_qwen2(5, tie_word_embeddings=False),
}


def family(case: str) -> str:
    return "qwen2" if case.startswith("qwen2") else "llama"


@pytest.fixture(scope="module")
def ar_checkpoints(tmp_path_factory):
    """Each AR case saved by transformers, and the transformers model itself."""
    root = tmp_path_factory.mktemp("ar")
    out = {}
    for case, build in AR_CASES.items():
        reference = build()
        out[case] = (save_hf(reference, root / case, family(case)), reference)
    return out


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llada") / "LLaDA-tiny"
    return directory, llada_checkpoint(directory, seed=6)


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dream") / "Dream-tiny"
    return directory, dream_checkpoint(directory, seed=7)


# --- Llama and Qwen2: causal logits equal transformers', for a prompt and for cached decode ---


@pytest.mark.parametrize("case", list(AR_CASES))
def test_ar_prompt_logits_equal_transformers(ar_checkpoints, case):
    directory, reference = ar_checkpoints[case]
    loaded = load_pretrained(directory)
    assert loaded.engine_kind == "ar"
    ids = sample_ids(13, seed=1, batch=2)
    with torch.no_grad():
        assert_close(loaded.model(ids), causal_logits(reference, ids), **TOLERANCE)


@pytest.mark.parametrize("case", list(AR_CASES))
def test_ar_cached_decode_equals_transformers_step_by_step(ar_checkpoints, case):
    directory, reference = ar_checkpoints[case]
    model = load_pretrained(directory).model
    prompt, continuation = sample_ids(7, seed=2), sample_ids(6, seed=3)
    cache = KVCache(model.config, batch=1, max_tokens=16)
    with torch.no_grad():
        assert_close(model(prompt, cache), causal_logits(reference, prompt), **TOLERANCE)
        sequence = prompt
        for step in range(continuation.shape[1]):
            token = continuation[:, step: step + 1]
            sequence = torch.cat([sequence, token], dim=1)
            assert_close(model(token, cache)[:, -1], causal_logits(reference, sequence)[:, -1], **TOLERANCE)
    assert int(cache.lengths[0]) == sequence.shape[1]


def test_ar_engine_greedy_output_equals_transformers_greedy(ar_checkpoints):
    directory, reference = ar_checkpoints["llama"]
    loaded = load_pretrained(directory)
    ids = encode_prompt(loaded.codec, "the cat sat", templated=False)
    expected = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(8):
            expected = torch.cat([expected, causal_logits(reference, expected)[:, -1:].argmax(-1)], dim=1)
    completion, _ = generate_once(loaded, "the cat sat", max_tokens=8, chat=False)
    wanted = expected[0, len(ids):].tolist()
    # Greedy decoding stops at an end id; random weights may pick one before eight tokens.
    ends = set(loaded.conventions.end_ids)
    cut = next((i for i, t in enumerate(wanted) if t in ends), len(wanted))
    assert completion.token_ids == wanted[:cut]


# --- LLaDA and Dream: every tensor consumed, bidirectional logits equal the reference's ---


def test_llada_consumes_every_tensor_and_matches_bidirectional_llama(llada):
    directory, reference = llada
    names = set(load_file(str(directory / "model.safetensors")))
    assert "model.transformer.blocks.0.attn_out.weight" in names and "model.transformer.wte.weight" in names
    loaded = load_pretrained(directory)  # refuses any unexpected or missing tensor
    config = loaded.model.config
    assert loaded.engine_kind == "diffusion" and not config.causal and not config.logits_shift
    assert config.num_kv_heads == config.num_heads  # LLaDA-8B has no GQA
    assert config.mask_token_id == loaded.conventions.mask_id == token_id("llada", "<|mdm_mask|>")
    assert len(names) == len(loaded.model.state_dict())  # one file tensor per parameter
    ids = sample_ids(11, seed=4, batch=2)
    with torch.no_grad():
        ours = loaded.model(ids)
        assert_close(ours, bidirectional_logits(reference, ids), **TOLERANCE)
        assert (ours - causal_logits(reference, ids)).abs().max() > 1e-2  # the mask really is off


def test_dream_consumes_every_tensor_and_matches_bidirectional_qwen2_with_the_shift(dream):
    directory, reference = dream
    names = set(load_file(str(directory / "model.safetensors")))
    assert "lm_head.weight" in names and "model.layers.1.self_attn.q_proj.bias" in names
    loaded = load_pretrained(directory)
    config = loaded.model.config
    assert loaded.engine_kind == "diffusion" and config.logits_shift and config.qkv_bias
    assert config.mask_token_id == token_id("dream", "<|mask|>")
    assert len(names) == len(loaded.model.state_dict())
    ids = sample_ids(10, seed=5, batch=2)
    with torch.no_grad():
        ours = loaded.model(ids)
        theirs = bidirectional_logits(reference, ids)
    assert_close(ours, theirs, **TOLERANCE)
    # Dream's sampler reads position p's prediction at p - 1 (logits shifted right by one); the
    # engines' window_logits with shift=True must read the same rows.
    shifted = torch.cat([theirs[:, :1], theirs[:, :-1]], dim=1)
    start, window = torch.tensor([4, 6]), 4
    rows = torch.arange(2)[:, None]
    positions = start[:, None] + torch.arange(window)
    assert_close(window_logits(ours, start, window, shift=True), shifted[rows, positions], **TOLERANCE)


def test_llada_file_names_match_the_published_layout(llada):
    directory, _ = llada
    names = set(load_file(str(directory / "model.safetensors")))
    for block_part in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out", "attn_norm",
                       "ff_norm"):
        assert f"model.transformer.blocks.1.{block_part}.weight" in names
    assert {"model.transformer.ln_f.weight", "model.transformer.ff_out.weight"} <= names


# --- files: shards, corruption, clear errors ---


def test_sharded_transformers_checkpoint_loads_the_same_as_unsharded(tmp_path):
    reference = hf_llama(8)
    single = save_hf(reference, tmp_path / "single", "llama")
    sharded = save_hf(reference, tmp_path / "sharded", "llama", max_shard_size="20KB")
    assert len(weight_files(sharded)) > 2 and (sharded / "model.safetensors.index.json").is_file()
    a, b = load_pretrained(single).model.state_dict(), load_pretrained(sharded).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_llada_loads_the_same_as_unsharded(tmp_path):
    llada_checkpoint(tmp_path / "one", seed=9)
    llada_checkpoint(tmp_path / "three", seed=9, shards=3)
    assert len(weight_files(tmp_path / "three")) == 3
    ids = sample_ids(9, seed=6)
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "one").model(ids), load_pretrained(tmp_path / "three").model(ids))


def test_truncated_shard_is_named(tmp_path):
    directory = save_hf(hf_llama(10), tmp_path / "ckpt", "llama", max_shard_size="20KB")
    shard = weight_files(directory)[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupted or truncated safetensors file"):
        load_pretrained(directory)


def test_corrupted_header_and_missing_shard_are_clear(tmp_path):
    dream_checkpoint(tmp_path / "dream", seed=11, shards=2)
    first, second = weight_files(tmp_path / "dream")
    data = bytearray(first.read_bytes())
    data[8:16] = b"\x00garbage"
    first.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{first.name}: corrupted or truncated"):
        load_pretrained(tmp_path / "dream")
    second.unlink()
    with pytest.raises(CheckpointError, match=rf"index lists shards that are missing: \['{second.name}'\]"):
        load_pretrained(tmp_path / "dream")


def test_missing_and_unexpected_llada_tensors_are_named(tmp_path):
    reference = llada_checkpoint(tmp_path / "llada", seed=12)
    state = load_file(str(tmp_path / "llada" / "model.safetensors"))
    del state["model.transformer.blocks.1.up_proj.weight"]
    state["model.transformer.blocks.0.att_proj.weight"] = torch.zeros(3)
    write_weights(tmp_path / "llada", state)
    with pytest.raises(CheckpointError, match=r"missing \['model\.transformer\.blocks\.1\.up_proj\.weight'\] "
                                              r"unexpected \['model\.transformer\.blocks\.0\.att_proj\.weight'\]"):
        load_pretrained(tmp_path / "llada")
    assert reference is not None


def test_wrong_shape_is_named(tmp_path):
    directory = save_hf(hf_qwen2(13), tmp_path / "qwen", "qwen2")
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 48
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight' has shape .* config\.json implies"):
        load_pretrained(directory)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture 'MistralForCausalLM'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"use_sliding_window": True, "max_window_layers": 0, "layer_types": None}, "sliding-window attention"),
])
def test_unsupported_configs_are_refused_by_name(ar_checkpoints, tmp_path, change, message):
    source, _ = ar_checkpoints["qwen2"]
    directory = tmp_path / "changed"
    directory.mkdir()
    for path in source.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(directory)


def test_a_sliding_window_that_covers_no_layer_loads(ar_checkpoints, tmp_path):
    """Qwen2 slides from layer `max_window_layers` on; at or past the layer count every layer is
    full attention, as transformers computes it, so the checkpoint loads and matches."""
    source, reference = ar_checkpoints["qwen2"]
    directory = copy_of(source, tmp_path / "no-sliding-layer")
    config = json.loads((directory / "config.json").read_text())
    config.pop("layer_types", None)
    (directory / "config.json").write_text(json.dumps(
        {**config, "use_sliding_window": True, "max_window_layers": config["num_hidden_layers"]}))
    ids = sample_ids(9, seed=9)
    with torch.no_grad():
        assert_close(load_pretrained(directory).model(ids), causal_logits(reference, ids), **TOLERANCE)


def test_llada_sequential_block_is_refused(tmp_path):
    llada_checkpoint(tmp_path / "llada", seed=14)
    path = tmp_path / "llada" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "block_type": "sequential"}))
    with pytest.raises(CheckpointError, match="block_type 'sequential'"):
        load_pretrained(tmp_path / "llada")


def copy_of(source, directory):
    directory.mkdir()
    for path in source.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return directory


def test_stored_rope_inverse_frequencies_are_ignored(ar_checkpoints, tmp_path):
    """Older Llama conversions store each layer's RoPE buffer; it is computed from the config."""
    source, reference = ar_checkpoints["llama"]
    directory = copy_of(source, tmp_path / "old-llama")
    state = load_file(str(directory / "model.safetensors"))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    write_weights(directory, state)
    ids = sample_ids(9, seed=8)
    with torch.no_grad():
        assert_close(load_pretrained(directory).model(ids), causal_logits(reference, ids), atol=1e-4, rtol=0)


def test_a_tied_checkpoint_whose_head_differs_is_refused(ar_checkpoints, tmp_path):
    source, _ = ar_checkpoints["llama"]
    directory = copy_of(source, tmp_path / "tied")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = load_file(str(directory / "model.safetensors"))
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match=r"ties the output head .* differs"):
        load_pretrained(directory)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # a tied file carrying the copy
    write_weights(directory, state)
    loaded = load_pretrained(directory)
    assert loaded.model.lm_head is None


def test_auto_dtype_is_the_checkpoints_own(ar_checkpoints, tmp_path):
    source, _ = ar_checkpoints["llama"]
    directory = copy_of(source, tmp_path / "bf16")
    config = json.loads((directory / "config.json").read_text())
    config.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert {p.dtype for p in load_pretrained(directory, dtype="auto").model.parameters()} == {torch.bfloat16}
    config.pop("torch_dtype", None)
    (directory / "config.json").write_text(json.dumps(config))
    assert {p.dtype for p in load_pretrained(directory, dtype="auto").model.parameters()} == {torch.float32}


# --- dtype and device ---


@pytest.mark.parametrize("dtype, torch_dtype, tolerance", [("bfloat16", torch.bfloat16, 0.3),
                                                            ("float16", torch.float16, 0.05)])
def test_half_precision_loads_close_to_float32(ar_checkpoints, dtype, torch_dtype, tolerance):
    directory, reference = ar_checkpoints["llama"]
    loaded = load_pretrained(directory, dtype=dtype)
    assert {p.dtype for p in loaded.model.parameters()} == {torch_dtype}
    ids = sample_ids(9, seed=7)
    with torch.no_grad():
        logits = loaded.model(ids)
    assert logits.dtype == torch_dtype
    assert_close(logits.float(), causal_logits(reference, ids), atol=tolerance, rtol=0.05)


def test_unknown_dtype_and_absent_cuda_are_clear(ar_checkpoints):
    directory, _ = ar_checkpoints["llama"]
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_pretrained(directory, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_pretrained(directory, device="cuda")


# --- conventions: end ids, mask, chat template, all from the files ---


def test_conventions_come_from_the_files(ar_checkpoints, llada, dream):
    llama = load_pretrained(ar_checkpoints["llama"][0]).conventions
    assert llama.end_ids == (token_id("llama", "<|end_of_text|>"), token_id("llama", "<|eot_id|>"))
    assert llama.bos_id == token_id("llama", "<|begin_of_text|>") and llama.mask_id is None
    qwen = load_pretrained(ar_checkpoints["qwen2"][0]).conventions
    assert qwen.end_ids == (token_id("qwen2", "<|im_end|>"), token_id("qwen2", "<|endoftext|>"))
    assert load_pretrained(llada[0]).conventions.end_ids == (token_id("llada", "<|endoftext|>"),)
    assert load_pretrained(dream[0]).conventions.end_ids == (token_id("dream", "<|endoftext|>"),)


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_chat_template_renders_and_encodes_as_transformers_does(ar_checkpoints, case):
    directory, _ = ar_checkpoints[case]
    loaded = load_pretrained(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Name the cat. "}]
    text = apply_chat_template(loaded.conventions, messages)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert encode_prompt(loaded.codec, text, templated=True) == theirs(text, add_special_tokens=False)["input_ids"]
    assert encode_prompt(loaded.codec, "hi", templated=False) == theirs("hi")["input_ids"]


def test_ar_engine_stops_at_any_end_id_of_the_checkpoint(ar_checkpoints, tmp_path):
    """An end id that is not the first one (Llama 3 Instruct's <|eot_id|>) still stops the AR engine."""
    directory, reference = ar_checkpoints["llama"]
    loaded = load_pretrained(directory)
    ids = encode_prompt(loaded.codec, "the cat sat", templated=False)
    with torch.no_grad():
        first = int(causal_logits(reference, torch.tensor([ids]))[0, -1].argmax())
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in directory.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, first]}))
    loaded = load_pretrained(copy)
    assert loaded.conventions.end_ids[0] == 1 and first in loaded.conventions.end_ids
    completion, _ = generate_once(loaded, "the cat sat", max_tokens=5, chat=False)
    assert completion.token_ids == [] and completion.finish_reason == "stop"


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_diffusion_engine_runs_on_real_layouts(llada, dream, which):
    directory, _ = {"llada": llada, "dream": dream}[which]
    loaded = load_pretrained(directory)
    completion, _ = generate_once(loaded, "the cat", max_tokens=8)
    assert completion.engine == "diffusion" and len(completion.token_ids) <= 8
    assert loaded.conventions.mask_id not in completion.token_ids
    assert not set(completion.token_ids) & set(loaded.conventions.end_ids)


def test_names_read_from_headers_only(llada):
    directory, _ = llada
    where = tensor_names(weight_files(directory))
    assert all(path.name == "model.safetensors" for path in where.values())


# --- the gateway serves a real checkpoint with its own conventions ---


def test_gateway_backend_uses_the_checkpoint_chat_template_and_end_ids(ar_checkpoints):
    from nowait.gateway.config import ArEngineConfig
    from nowait.gateway.domain import Call, Metadata
    from nowait.gateway.engines import ModelCache, build_owned
    from nowait.router import DataClass

    directory, _ = ar_checkpoints["llama"]
    cache = ModelCache()
    backend = build_owned("llama", ArEngineConfig(kind="ar", model=str(directory), max_num_seqs=2,
                                                  max_num_batched_tokens=64, max_model_len=64),
                          cache, window_s=60.0, default_max_tokens=8)
    assert backend.available, getattr(backend, "unavailable_reason", "")
    loaded = cache.load(str(directory), "float32", "cpu")
    messages = [{"role": "user", "content": "Name the cat."}]
    call = Call(request_id="t", endpoint="chat", model="llama", messages=messages,
                meta=Metadata(None, 1.0, DataClass.internal, False))
    expected = encode_prompt(loaded.codec, apply_chat_template(loaded.conventions, messages), templated=True)
    request = backend.generation_request(call)
    assert request.prompt_ids == expected and expected[0] == loaded.conventions.bos_id
    # Every end id stops the engine itself; none is smuggled into the request as a stop id.
    assert request.sampling.stop_token_ids == ()
    assert backend.worker.engine.end_ids == loaded.conventions.end_ids == (
        token_id("llama", "<|end_of_text|>"), token_id("llama", "<|eot_id|>"))
    assert backend.worker.engine.end_id == token_id("llama", "<|end_of_text|>")


def test_gateway_diffusion_backend_on_a_dream_checkpoint(dream):
    from nowait.gateway.config import DiffusionEngineConfig
    from nowait.gateway.engines import ModelCache, build_owned

    backend = build_owned("dream", DiffusionEngineConfig(kind="diffusion", model=str(dream[0]), max_batch=2),
                          ModelCache(), window_s=60.0, default_max_tokens=8)
    assert backend.available, getattr(backend, "unavailable_reason", "")
    assert backend.worker.engine.mask_id == token_id("dream", "<|mask|>")
    assert backend.worker.engine.model.config.logits_shift
