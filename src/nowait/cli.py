"""The `nowait` command line: one Typer app."""

from __future__ import annotations

import json
import shutil
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from nowait import paths
from nowait.bench import bench_app
from nowait.cli_errors import fail
from nowait.demo.cli import register as register_demo
from nowait.eval_cli import load_model
from nowait.eval_cli import register as register_eval
from nowait.fleet.cli import register as register_fleet
from nowait.gateway.audit.cli import register as register_audit
from nowait.gateway.cli import register as register_serve
from nowait.gateway.keys_cli import keys_app
from nowait.planner.cli import register as register_plan

app = typer.Typer(help="nowait: route each request to the engine that pays, and plan the fleet.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")
app.add_typer(keys_app, name="keys")
register_eval(app)
register_plan(app)
register_serve(app)
register_demo(app)
register_audit(app)
register_fleet(app)
console = Console()
err_console = Console(stderr=True)


@app.callback()
def root() -> None:
    """nowait: route each request to the engine that pays, and plan the fleet."""
    from nowait.host_memory import keep_freed_memory

    keep_freed_memory()  # before any engine allocates: a CPU step's temporaries stop faulting pages in


class TrainKind(str, Enum):
    ar = "ar"
    draft = "draft"
    diffusion = "diffusion"


class TrainTier(str, Enum):
    clean = "clean"
    hard = "hard"
    mixed = "mixed"


@app.command()
def train(
    kind: TrainKind = typer.Argument(..., help="ar (target), draft (speculative draft) or diffusion"),
    steps: int = typer.Option(None, min=1, help="total optimizer steps (default per kind)"),
    batch_size: int = typer.Option(16, min=1),
    learning_rate: float = typer.Option(None, help="peak learning rate (default per kind)"),
    eval_every: int = typer.Option(500, min=1),
    eval_documents: int = typer.Option(60, min=1, help="validation documents per periodic evaluation"),
    threads: int = typer.Option(2, min=1),
    seed: int = typer.Option(0),
    run_dir: Path = typer.Option(None, help="checkpoints and log (default runs/KIND)"),
    out: Path = typer.Option(None, help="exported model directory (default: the bundled assets)"),
    init_from: Path = typer.Option(None, help="start from this checkpoint's weights (diffusion default: bundled "
                                              "ar; to train a bundled model on, pass its own directory)"),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N"),
    data_workers: int = typer.Option(0, min=0, help="processes building batches ahead of the optimizer (a GPU "
                                             "needs several to stay busy)"),
    minutes: float = typer.Option(None, help="time budget: the total steps are planned from the measured "
                                             "rate so the learning rate still decays at the end (--steps "
                                             "then caps them)"),
    data_start: int = typer.Option(0, min=0, help="first training-document index of a new run (a run continuing "
                                           "from --init-from should read documents it has not seen)"),
    prompt_isolation: float = typer.Option(0.0, help="diffusion: share of rows whose prompt attends only to "
                                                     "itself, as under the engine's prompt cache"),
    tier: TrainTier = typer.Option(TrainTier.clean, help="corpus tier to train and validate on: clean (today's "
                                                         "stream), hard, or mixed (half hard)"),
    hard_fraction: float = typer.Option(None, help="share of hard-tier training documents (default from --tier: "
                                                   "clean 0, mixed 0.5, hard 1)"),
) -> None:
    """Train a demo model (resumes from RUN_DIR/state.pt when present)."""
    from nowait.checkpoints import check_device
    from nowait.training import ResumeError, TrainSettings
    from nowait.training import train as run_training

    defaults = {"ar": (12000, 2e-3), "draft": (8000, 3e-3), "diffusion": (8000, 1e-3)}[kind.value]
    if not 0.0 <= prompt_isolation <= 1.0:
        fail(f"--prompt-isolation must be in [0, 1], got {prompt_isolation}")
    if hard_fraction is None:
        hard_fraction = {"clean": 0.0, "mixed": 0.5, "hard": 1.0}[tier.value]
    if not 0.0 <= hard_fraction <= 1.0:
        fail(f"--hard-fraction must be in [0, 1], got {hard_fraction}")
    if minutes is not None and minutes <= 0:
        fail(f"--minutes must be positive, got {minutes}")
    try:
        check_device(device)
    except ValueError as error:
        fail(str(error))
    if steps is None:
        steps = 10**9 if minutes else defaults[0]
    settings = TrainSettings(
        kind=kind.value, steps=steps, batch_size=batch_size,
        learning_rate=learning_rate or defaults[1], eval_every=eval_every,
        eval_documents=eval_documents, threads=threads, seed=seed, device=device, data_workers=data_workers,
        minutes=minutes, data_start=data_start, prompt_isolation=prompt_isolation,
        hard_fraction=hard_fraction, eval_tier=tier.value,
    )
    if kind is TrainKind.diffusion:
        init_from = init_from or paths.model_dir("ar")
    if init_from:
        settings.init_from = str(init_from)
        settings.clean_steps = settings.curriculum_steps = 0  # the weights already read documents
    run_dir = run_dir or Path("runs") / kind.value
    out = out or paths.model_dir(kind.value)
    columns = [TextColumn("[bold]train " + kind.value), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, refresh_per_second=2) as progress:
        task = progress.add_task("train", total=None if minutes else settings.steps, status="")
        last: dict = {}

        def report(step: int, record: dict) -> None:
            if "eval" in record:
                last["eval"] = record["eval"]["field_accuracy"]
            if "answer_loss_avg10" in record:
                last["loss"] = record["answer_loss_avg10"]
            status = f"answer loss {last.get('loss', float('nan')):.3f}"
            if "eval" in last:
                status += f"  val field acc {last['eval']:.3f}"
            progress.update(task, completed=step, total=record.get("steps", settings.steps), status=status)

        try:
            result = run_training(settings, run_dir, out, paths.tokenizer_path(), progress=report)
        except ResumeError as error:
            progress.stop()
            fail(str(error))
    shutil.copy2(run_dir / "log.jsonl", Path(out) / "training_log.jsonl")
    console.print_json(json.dumps(result))


@app.command()
def extract(
    file: Path = typer.Argument(None, help="a text document (default: the bundled sample KYC form)"),
    kind: str = typer.Option(None, help="kyc, letter_of_credit or loan_application (default: guessed)"),
    engine: str = typer.Option("ar", help="ar or diffusion"),
    model: str = typer.Option(None, help="checkpoint directory (default: the bundled model of the engine)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object with the extraction and its stats"),
) -> None:
    """Extract one document to JSON and say how it was produced."""
    from nowait.evaluation import check_engine
    from nowait.evaluation import extract as run_extract

    if engine not in ("ar", "diffusion"):
        fail(f"unknown engine {engine!r}; choose ar or diffusion")
    path = file or paths.sample_document()
    if not path.is_file():
        fail(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as error:
        fail(f"{path}: cannot read as UTF-8 text ({error})")
    loaded = load_model(model or engine)
    try:
        check_engine(loaded.model, engine)
        result = run_extract(loaded.model, loaded.codec, text, kind)
    except ValueError as error:
        fail(f"{path}: {error}")
    how = {
        "engine": engine, "model": str(loaded.path), "kind": result.kind,
        "decoding": "greedy, KV cache" if engine == "ar" else
                    "the engine's fast default: confidence-threshold commits, dual cache, blocks of 32",
        "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
        "forwards": result.forwards, "tokens_per_forward": round(result.tokens_per_forward, 2),
        "seconds": round(result.seconds, 3), "schema_valid": result.schema_valid,
    }
    if as_json:
        print(json.dumps({"extraction": result.value, "text": result.text, **how}))
        return
    console.print_json(result.text) if result.value is not None else console.print(result.text, highlight=False)
    console.print(", ".join(f"{k}={v}" for k, v in how.items()), style="dim", highlight=False)


class EngineKind(str, Enum):
    ar = "ar"
    diffusion = "diffusion"


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"  # the checkpoint's own (config.json torch_dtype)


@app.command()
def generate(
    model: str = typer.Option(..., "--model", help="checkpoint directory (Llama, Qwen2, LLaDA, Dream) "
                                                   "or a bundled demo model: ar, draft, diffusion"),
    prompt: str = typer.Option(..., "--prompt", help="the user message (wrapped in the model's chat template)"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="tokens to generate at most"),
    engine: EngineKind = typer.Option(None, "--engine", help="ar or diffusion (default: what the checkpoint is)"),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above 0: sampled"),
    seed: int = typer.Option(None, "--seed", help="seed of the sampler (with --temperature)"),
    dtype: Dtype = typer.Option(Dtype.float32, "--dtype", help="weights and activations: float32, bfloat16, "
                                                               "float16, or auto (the checkpoint's own)"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N"),
    raw: bool = typer.Option(False, "--raw", help="encode the prompt as is, without the chat template"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (text, token_ids, stats)"),
) -> None:
    """Generate from one prompt with a checkpoint from a local path, greedy unless a temperature is given."""
    from nowait.checkpoints import CheckpointError, load_pretrained
    from nowait.engines.base import InvalidRequestError
    from nowait.generate import completion_record, generate_once

    if max_tokens < 1:
        fail("--max-tokens must be at least 1")
    if temperature < 0:
        fail("--temperature must be >= 0")
    try:
        loaded = load_pretrained(paths.model_dir(model), dtype=dtype.value, device=device,
                                 engine=engine.value if engine else None)
        completion, seconds = generate_once(loaded, prompt, max_tokens, temperature, seed, chat=not raw)
    except (CheckpointError, InvalidRequestError, ValueError) as error:
        fail(str(error))
    loaded_dtype = str(loaded.model.output_weight().dtype).removeprefix("torch.")  # `auto` resolved
    record = completion_record(loaded, completion, seconds, loaded_dtype, device)
    if as_json:
        print(json.dumps(record, ensure_ascii=False))
        return
    print(completion.text)
    stats = ("engine", "finish_reason", "prompt_tokens", "completion_tokens", "forwards", "seconds")
    err_console.print(", ".join(f"{k}={record[k]}" for k in stats), style="dim", highlight=False)


@app.command("export-gguf")
def export_gguf(
    model_dir: str = typer.Argument(..., help="causal Llama checkpoint directory or bundled model (ar, draft)"),
    out: Path = typer.Argument(..., help="the GGUF file to write"),
) -> None:
    """Write a checkpoint as one GGUF file (f32, tokenizer included) that llama.cpp runs (docs/bench.md)."""
    from nowait.export_gguf import ExportError
    from nowait.export_gguf import export_gguf as write_gguf

    try:
        written = write_gguf(load_model(model_dir), out)
    except ExportError as error:
        fail(str(error))
    console.print_json(json.dumps(written))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
