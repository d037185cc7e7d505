"""`nowait train` killed after a checkpoint and run again resumes from RUN_DIR/state.pt and ends
exactly where the unbroken run ends: same weights, optimizer state, data index, log and export.

The kill is a real SIGKILL of a process running `nowait train`, sent by the process itself from the
progress callback at a chosen step: nothing of the run is flushed, closed or saved after it, and
the step is fixed, so the test never races the checkpoint's write. The process is a fork of the
test's own, so it starts with torch and nowait imported (a fresh interpreter spends seconds on that).

Exact equality is what training.py promises here: batches are a pure function of their pool's
first data index, the checkpoint stores the index of the next pool, and with batch size 1 a pool
is BUCKETS batches, so a checkpoint every BUCKETS steps falls on a pool boundary and the resumed
run reads the very batches the unbroken one read (off a boundary up to BUCKETS - 1 batches would
be skipped, as batch_stream documents).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from nowait import paths, training
from nowait.checkpoints import save_pretrained
from nowait.cli import app
from nowait.tokenizer import TextCodec

from .conftest import build_model

STEPS, EVAL_EVERY, KILL_AT = 8, 4, 6  # checkpoints at 4 and 8; the kill falls between them
assert EVAL_EVERY % training.BUCKETS == 0 and EVAL_EVERY < KILL_AT < STEPS


@pytest.fixture(scope="module")
def tiny_start(tmp_path_factory) -> Path:
    """A tiny random AR checkpoint with the bundled tokenizer (training reads it), for --init-from: the
    command then trains this model instead of the full-size preset."""
    codec = TextCodec.from_file(paths.tokenizer_path())
    model = build_model(vocab_size=codec.vocab_size, max_position=1024)  # room for a corpus prompt and answer
    return save_pretrained(model, codec, tmp_path_factory.mktemp("resume") / "start")


def train_args(start: Path, run: Path) -> list[str]:
    return ["train", "ar", "--init-from", str(start), "--steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
            "--batch-size", "1", "--eval-documents", "1", "--threads", "1", "--run-dir", str(run / "run"),
            "--out", str(run / "out")]


def train(start: Path, run: Path) -> dict:
    result = CliRunner().invoke(app, train_args(start, run))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{"):])  # the JSON after the progress bar


def train_until_killed(start: Path, run: Path) -> None:
    """In the forked process: `nowait train`, whose progress callback SIGKILLs the process at KILL_AT."""
    run_training = training.train

    def train_then_die(*args, progress, **kwargs):
        def report(step: int, record: dict) -> None:
            progress(step, record)
            if step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)

        return run_training(*args, progress=report, **kwargs)

    training.train = train_then_die  # the command imports it when it runs; this process is a copy
    CliRunner().invoke(app, train_args(start, run))


def state(run: Path) -> dict:
    return torch.load(run / "run" / "state.pt", weights_only=False)


def log(path: Path) -> list[dict]:
    """The log's records without their wall-clock times."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in record.items() if k != "elapsed_s"} for record in records]


def assert_same_tensors(one, two, where: str = "") -> None:
    """Nested dicts/lists of tensors and numbers, equal bit for bit; a difference is named by its path."""
    if isinstance(one, torch.Tensor):
        assert torch.equal(one, two), f"{where}: tensors differ"
    elif isinstance(one, dict):
        assert one.keys() == two.keys(), where
        for key in one:
            assert_same_tensors(one[key], two[key], f"{where}[{key!r}]")
    elif isinstance(one, list | tuple):
        assert len(one) == len(two), where
        for index, (a, b) in enumerate(zip(one, two, strict=True)):
            assert_same_tensors(a, b, f"{where}[{index}]")
    else:
        assert one == two, where


def test_a_killed_run_resumes_to_the_unbroken_result(tiny_start, tmp_path):
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    assert train(tiny_start, unbroken)["step"] == STEPS

    killed = multiprocessing.get_context("fork").Process(target=train_until_killed, args=(tiny_start, broken))
    killed.start()
    killed.join(timeout=300)  # a bound on a hang, not a speed check
    assert killed.exitcode == -signal.SIGKILL
    at_kill = state(broken)
    assert at_kill["step"] == EVAL_EVERY  # the last checkpoint before the kill
    assert not (broken / "run" / "settings.json").exists()  # written only when a run ends
    assert [record["step"] for record in log(broken / "run" / "log.jsonl")] == [EVAL_EVERY]

    assert train(tiny_start, broken)["step"] == STEPS
    resumed, expected = state(broken), state(unbroken)
    # the resumed steps moved the weights: equality below is not the checkpoint left as it was
    assert not all(torch.equal(a, b) for a, b in zip(at_kill["model"].values(), resumed["model"].values(),
                                                       strict=True))
    assert_same_tensors(resumed["model"], expected["model"], "model")
    assert_same_tensors(resumed["optimizer"], expected["optimizer"], "optimizer")
    for key in ("step", "data_index", "best", "steps"):
        assert resumed[key] == expected[key], key
    assert log(broken / "run" / "log.jsonl") == log(unbroken / "run" / "log.jsonl")
    assert log(broken / "out" / "training_log.jsonl") == log(unbroken / "out" / "training_log.jsonl")
    assert_same_tensors(load_file(broken / "out" / "model.safetensors"),
                        load_file(unbroken / "out" / "model.safetensors"), "export")


def test_a_state_whose_optimizer_fits_other_parameters_is_refused_in_one_line(tiny_start, tmp_path):
    """A state.pt of an older layout (separate q/k/v and gate/up projections, so more parameters
    than this model has) keeps its weights readable but cannot resume: one line, exit 2, and the
    file left as it was."""
    model = build_model(vocab_size=TextCodec.from_file(paths.tokenizer_path()).vocab_size, max_position=1024)
    more_parameters = [*model.parameters(), torch.nn.Parameter(torch.zeros(3))]
    optimizer = torch.optim.AdamW(more_parameters)
    (tmp_path / "run").mkdir()
    written = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 4, "data_index": 0,
               "best": -1.0}
    torch.save(written, tmp_path / "run" / "state.pt")
    before = (tmp_path / "run" / "state.pt").read_bytes()
    result = CliRunner().invoke(app, train_args(tiny_start, tmp_path))
    assert result.exit_code == 2, result.output
    assert "its optimizer state does not fit this model's parameters" in result.output
    assert "Traceback" not in result.output
    assert (tmp_path / "run" / "state.pt").read_bytes() == before


def train_killed_while_saving(start: Path, run: Path) -> None:
    """In the forked process: `nowait train`, killed halfway through writing its second checkpoint."""
    real_save, saves = torch.save, []

    def dying_save(state, target, *args, **kwargs):
        saves.append(target)
        if len(saves) == 2:  # the checkpoint at step 8: part of the file written, then the kill
            Path(target).write_bytes(b"half a checkpoint")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(state, target, *args, **kwargs)

    torch.save = dying_save  # this process is a copy: the test's own torch is untouched
    CliRunner().invoke(app, train_args(start, run))


def test_a_run_killed_while_writing_its_checkpoint_keeps_the_previous_one(tiny_start, tmp_path):
    killed = multiprocessing.get_context("fork").Process(target=train_killed_while_saving, args=(tiny_start, tmp_path))
    killed.start()
    killed.join(timeout=300)
    assert killed.exitcode == -signal.SIGKILL
    assert state(tmp_path)["step"] == EVAL_EVERY  # the checkpoint before the one cut short, whole
    assert train(tiny_start, tmp_path)["step"] == STEPS  # and the run resumes from it
