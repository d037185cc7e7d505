"""`nowait generate`: a checkpoint from a local path, its own engine and conventions, --json output."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from nowait.cli import app

from .hf_checkpoints import causal_logits, hf_llama, llada_checkpoint, save_hf

transformers = pytest.importorskip("transformers")
runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    llama = hf_llama(21)
    save_hf(llama, root / "llama", "llama")
    llada_checkpoint(root / "llada", seed=22)
    return {"llama": (root / "llama", llama), "llada": (root / "llada", None)}


def run_json(*args: str) -> dict:
    result = runner.invoke(app, ["generate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_json_is_greedy_ar_under_the_chat_template(checkpoints):
    directory, reference = checkpoints["llama"]
    record = run_json("--model", str(directory), "--prompt", "Name the cat.", "--max-tokens", "6")
    assert record["engine"] == "ar" and record["architecture"] == "LlamaForCausalLM"
    theirs = transformers.AutoTokenizer.from_pretrained(str(directory))
    text = theirs.apply_chat_template([{"role": "user", "content": "Name the cat."}], add_generation_prompt=True,
                                      tokenize=False)
    ids = torch.tensor([theirs(text, add_special_tokens=False)["input_ids"]])
    assert record["prompt_tokens"] == ids.shape[1]
    expected, ended = [], False
    with torch.no_grad():
        for _ in range(6):
            token = int(causal_logits(reference, ids)[0, -1].argmax())
            if token in (1, 4):  # the checkpoint's end ids: <|end_of_text|>, <|eot_id|>
                ended = True
                break
            expected.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert record["token_ids"] == expected  # generated ids only, no prompt, no end token
    assert record["text"] == theirs.decode(expected, skip_special_tokens=True)
    assert record["completion_tokens"] == len(expected) + ended  # the end token counts when generated


def test_generate_reads_the_engine_from_the_checkpoint_and_takes_an_override(checkpoints):
    directory, _ = checkpoints["llada"]
    record = run_json("--model", str(directory), "--prompt", "the cat", "--max-tokens", "8")
    assert record["engine"] == "diffusion" and record["architecture"] == "LLaDAModelLM"
    assert isinstance(record["text"], str) and len(record["token_ids"]) <= 8
    record = run_json("--model", str(directory), "--prompt", "the cat", "--max-tokens", "4", "--engine", "ar")
    assert record["engine"] == "ar"


def test_generate_samples_reproducibly_with_a_seed(checkpoints):
    directory, _ = checkpoints["llama"]
    args = ("--model", str(directory), "--prompt", "hello", "--max-tokens", "8", "--temperature", "1.5",
            "--raw", "--dtype", "bfloat16")
    first, second = run_json(*args, "--seed", "3"), run_json(*args, "--seed", "3")
    assert first["token_ids"] == second["token_ids"] and first["dtype"] == "bfloat16"


def test_generate_plain_output_is_the_text(checkpoints):
    directory, _ = checkpoints["llama"]
    record = run_json("--model", str(directory), "--prompt", "hi", "--max-tokens", "3")
    result = runner.invoke(app, ["generate", "--model", str(directory), "--prompt", "hi", "--max-tokens", "3"])
    assert result.exit_code == 0
    assert result.stdout.rstrip("\n") == record["text"]


@pytest.mark.parametrize("args, fragment", [
    (["--model", "/nonexistent/ckpt", "--prompt", "x"], "no such checkpoint directory"),
    (["--prompt", "x", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--prompt", "x", "--engine", "diffusion"], "needs a mask token"),
    (["--prompt", "x", "--max-tokens", "500"], "exceeds the model's 128 positions"),
])
def test_generate_errors_are_one_clear_line(checkpoints, args, fragment):
    directory, _ = checkpoints["llama"]
    if "--model" not in args:
        args = ["--model", str(directory), *args]
    result = runner.invoke(app, ["generate", *args])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.output, result.output


def test_eval_takes_a_path_and_refuses_a_tokenizer_without_the_demo_end_token(checkpoints):
    directory, _ = checkpoints["llama"]
    result = runner.invoke(app, ["eval", "--engine", "ar", "--n", "1", "--model", str(directory)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "use `nowait generate`" in lines[0], result.output
