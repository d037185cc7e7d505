"""The `nowait` command line: one Typer app."""

from __future__ import annotations

import json
import shutil
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from nowait import paths
from nowait.bench import bench_app
from nowait.cli_errors import fail
from nowait.demo.cli import register as register_demo
from nowait.fleet.cli import register as register_fleet
from nowait.gateway.audit.cli import register as register_audit
from nowait.gateway.cli import register as register_serve
from nowait.gateway.keys_cli import keys_app
from nowait.planner.cli import register as register_plan

if TYPE_CHECKING:  # torch and the engines load when a command runs, not with the CLI
    from nowait.checkpoints import LoadedModel
    from nowait.engines.ar import AutoregressiveEngine
    from nowait.engines.factory import ModelCache

app = typer.Typer(help="nowait: route each request to the engine that pays, and plan the fleet.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")
app.add_typer(keys_app, name="keys")
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


class TrainKind(str, Enum):
    ar = "ar"
    draft = "draft"
    diffusion = "diffusion"


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
) -> None:
    """Train a demo model (resumes from RUN_DIR/state.pt when present)."""
    from nowait.checkpoints import check_device
    from nowait.training import ResumeError, TrainSettings
    from nowait.training import train as run_training

    defaults = {"ar": (12000, 2e-3), "draft": (8000, 3e-3), "diffusion": (8000, 1e-3)}[kind.value]
    if not 0.0 <= prompt_isolation <= 1.0:
        fail(f"--prompt-isolation must be in [0, 1], got {prompt_isolation}")
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


def _load_model(model: str, device: str = "cpu", models: ModelCache | None = None) -> LoadedModel:
    """Load a bundled demo model by name or a checkpoint directory by path, as the engine factory
    loads the models a config names (through `models`, so engines named alike share weights), or
    fail clearly."""
    from nowait.checkpoints import CheckpointError
    from nowait.engines.factory import ModelCache

    try:
        loaded = (models or ModelCache()).load(model, device=device)
    except (CheckpointError, ValueError) as error:  # ValueError: a device this machine lacks
        fail(str(error))
    if loaded.codec.end_id is None:
        # eval and extract decode with the demo prompt and its <|endoftext|> end token.
        fail(f"{loaded.path}: eval and extract need the demo tokenizer's <|endoftext|> token, which this "
             "checkpoint's tokenizer lacks; use `nowait generate` for it")
    return loaded


@app.command("eval")
def evaluate(
    engine: str = typer.Option("ar", help="ar, spec (AR + speculative decoding) or diffusion"),
    n: int = typer.Option(100, help="documents to decode"),
    split: str = typer.Option("test", help="validation or test (ignored with --seed)"),
    seed: int = typer.Option(None, help="a fresh sample of the same distribution, never seen in training"),
    model: str = typer.Option(None, help="checkpoint directory (default: the bundled model of the engine)"),
    batch_size: int = typer.Option(32),
    policy: str = typer.Option(None, help="diffusion: fixed (LLaDA), threshold or factor (Fast-dLLM); "
                                          "default: the engine's fast default"),
    tau: float = typer.Option(None, help="diffusion threshold policy: commit positions at least this sure, in (0, 1]"),
    block: int = typer.Option(None, help="diffusion block length in tokens (default: the engine's)"),
    cache: str = typer.Option(None, help="diffusion cache: none, prompt, prefix or dual"),
    refresh: str = typer.Option(None, help="diffusion dual cache, at each block after the first: window (recompute "
                                           "the whole window) or blocks (the finished block and the new one)"),
    cache_decoded: bool = typer.Option(None, "--cache-decoded/--no-cache-decoded",
                                       help="diffusion dual cache: keep settled tokens' keys/values within a block "
                                            "(default: on)"),
    structured: bool = typer.Option(False, "--structured", help="JSON valid for the document kind's schema: "
                                    "template infilling (diffusion) or a grammar (ar, spec)"),
    method: str = typer.Option("hybrid", help="spec: hybrid (prompt lookup, else the draft model), draft (the "
                                              "draft model), ngram (prompt lookup, no draft) or diffusion (the "
                                              "diffusion model drafts the answer)"),
    gamma: int = typer.Option(None, help="spec: tokens proposed per target pass, at most (default: the method's "
                                         "tuned setting)"),
    draft: str = typer.Option(None, help="spec: draft checkpoint directory for methods hybrid and draft "
                                         "(default: the bundled draft), or the diffusion checkpoint for method "
                                         "diffusion (default: the bundled diffusion)"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice)"),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N (engines ar and diffusion)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Decode N held-out documents and score the JSON: accuracy, validity, forwards and latency."""
    import torch

    from nowait.engines.factory import ModelCache
    from nowait.engines.speculative import SPEC_METHODS
    from nowait.evaluation import ENGINES, check_engine, diffusion_options, run_engine_eval, run_eval

    if engine not in ENGINES:
        fail(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    if seed is None and split not in ("validation", "test"):
        fail(f"unknown split {split!r}; choose validation or test (or give --seed)")
    if n < 1:
        fail("--n must be at least 1")
    if batch_size < 1:
        fail("--batch-size must be at least 1")
    diffusion_flags = {"--policy": policy, "--tau": tau, "--block": block, "--cache": cache, "--refresh": refresh,
                       "--cache-decoded": cache_decoded}
    if engine in ("ar", "spec"):
        given = [flag for flag, value in diffusion_flags.items() if value is not None]
        if given:
            fail(f"{', '.join(given)} apply to --engine diffusion only")
        if engine == "spec" and method not in SPEC_METHODS:
            fail(f"unknown speculative method {method!r}; choose {', '.join(SPEC_METHODS)}")
        if gamma is not None and gamma < 1:
            fail("--gamma must be at least 1")
    else:
        try:
            diffusion_options(policy, tau, block, cache, refresh=refresh, cache_decoded=cache_decoded)
        except ValueError as error:
            fail(str(error))
    if device != "cpu" and (engine == "spec" or (structured and engine == "ar")):
        fail("--device applies to plain ar and diffusion decoding; spec and structured ar run on the CPU")
    if threads:
        torch.set_num_threads(threads)
    models = ModelCache()
    loaded = _load_model(model or ("ar" if engine == "spec" else engine), device, models)
    try:
        check_engine(loaded.model, engine)
    except ValueError as error:
        fail(str(error))
    serving = None
    if engine == "spec" or (engine == "ar" and structured):
        # Built before the progress bar, so a refused draft is one clear line.
        serving = _serving_engine(models, loaded, engine, batch_size, structured, method, gamma, draft)
    columns = [TextColumn(f"[bold]eval {engine}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=err_console, transient=as_json) as progress:
        task = progress.add_task("eval", total=n)
        advance = lambda k: progress.advance(task, k)  # noqa: E731
        try:
            if serving is not None:
                # Speculation runs at batch size 1, where it pays; constrained AR batched.
                result = run_engine_eval(serving, loaded.codec, n, split, seed, structured,
                                         one_at_a_time=engine == "spec", on_batch=advance)
            else:
                result = run_eval(loaded.model, loaded.codec, engine, n, split=split, seed=seed,
                                  batch_size=batch_size, block=block, policy=policy, tau=tau, cache=cache,
                                  structured=structured, on_batch=advance, refresh=refresh,
                                  cache_decoded=cache_decoded)
        except ValueError as error:
            fail(str(error))
    result["settings"]["model"] = str(loaded.path)
    result["settings"]["device"] = device
    if as_json:
        print(json.dumps(result))
        return
    _print_eval_table(result)


def _serving_engine(models: ModelCache, loaded: LoadedModel, engine: str, batch_size: int, structured: bool,
                    method: str, gamma: int | None, draft: str | None) -> AutoregressiveEngine:
    """The serving engine `eval --engine spec` and `eval --engine ar --structured` run, from the
    engine factory, or fail clearly: a missing draft, or one trained with another tokenizer than
    the target's."""
    from nowait.checkpoints import CheckpointError
    from nowait.engines.ar import EngineConfig
    from nowait.engines.config import ArEngineConfig, SpecEngineConfig
    from nowait.engines.factory import build_engine
    from nowait.engines.speculative import IncompatibleDraftError

    target = str(loaded.path)
    if engine != "spec":
        # The AR engine's own token budget per step, as eval has always batched.
        config = ArEngineConfig(kind="ar", model=target, max_num_seqs=batch_size, structured=structured,
                                max_num_batched_tokens=max(batch_size, EngineConfig.max_num_batched_tokens))
    else:
        config = SpecEngineConfig(kind="spec", model=target, method=method, draft=draft, gamma=gamma, max_num_seqs=1,
                                  structured=structured)
    try:
        return build_engine(config, models).engine
    except IncompatibleDraftError as error:
        fail(f"draft {paths.model_dir(config.draft_model)}: {error}; use a draft trained with the target's tokenizer "
             "(nowait train draft), or --method ngram")
    except (CheckpointError, ValueError) as error:
        fail(str(error))


def _print_eval_table(result: dict) -> None:
    from rich.table import Table

    table = Table(title=f"nowait eval ({result['settings']['engine']}, n={result['n']})")
    for column in ("kind", "n", "field acc", "present field acc", "doc acc", "JSON valid"):
        table.add_column(column, justify="right" if column != "kind" else "left")
    rows = [(kind, m) for kind, m in result["per_kind"].items()] + [("all", result)]
    for kind, m in rows:
        table.add_row(kind, str(m["n"]), f"{m['field_accuracy']:.3f}", f"{m['present_field_accuracy']:.3f}",
                      f"{m['doc_accuracy']:.3f}", f"{m['json_valid_rate']:.3f}")
    console.print(table)
    console.print(f"{result['settings']['decoding']}; {result['elapsed_s']} s; "
                  f"{result['forwards_per_doc']} forwards/doc, {result['tokens_per_forward']} tokens/forward, "
                  f"latency p50 {result['latency_ms_p50']} ms, p95 {result['latency_ms_p95']} ms", highlight=False)


@app.command()
def calibrate(
    model: str = typer.Option("diffusion", help="the diffusion model to calibrate (bundled name or checkpoint path)"),
    ar_model: str = typer.Option("ar", help="the AR model answers fall back to (its accuracy is the default target)"),
    n: int = typer.Option(200, help="held-out documents to decode"),
    split: str = typer.Option("validation", help="validation or test"),
    target: float = typer.Option(None, help="field accuracy the kept diffusion answers must reach (default: the AR "
                                            "model's on the same documents)"),
    structured: bool = typer.Option(True, "--structured/--free-form", help="schema-template answers (the "
                                    "real-time extraction route) or free-form ones"),
    batch_size: int = typer.Option(8),
    write: bool = typer.Option(True, "--write/--no-write", help="write calibration.json beside the model"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Choose the confidence threshold below which diffusion answers fall back to AR, on held-out data."""
    import torch

    from nowait.calibration import calibrate as run_calibration
    from nowait.calibration import write_calibration
    from nowait.engines.factory import ModelCache
    from nowait.evaluation import check_engine

    if split not in ("validation", "test"):
        fail(f"unknown split {split!r}; choose validation or test")
    if split == "test" and write:
        # The written threshold is what serving and the benchmarks then use: chosen on test
        # documents, those documents would no longer be held out.
        fail("--split test chooses a threshold on the documents the benchmarks score: add --no-write to look only")
    if n < 1 or batch_size < 1:
        fail("--n and --batch-size must be at least 1")
    if target is not None and not 0 < target <= 1:
        fail(f"--target must be in (0, 1], got {target}")
    if threads:
        torch.set_num_threads(threads)
    models = ModelCache()
    diffusion, ar = _load_model(model, models=models), _load_model(ar_model, models=models)
    try:
        check_engine(diffusion.model, "diffusion")
        check_engine(ar.model, "ar")
    except ValueError as error:
        fail(str(error))
    if not ar.codec.same_ids_as(diffusion.codec):
        fail(f"{ar.path} and {diffusion.path} have different tokenizers; calibrate against the AR model that serves "
             "the fallback")
    columns = [TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=err_console, transient=as_json) as progress:
        task = progress.add_task("calibrate", total=n)
        try:
            result = run_calibration(diffusion.model, ar.model, diffusion.codec, n, split, structured, target,
                                     batch_size, on_batch=lambda k: progress.advance(task, k))
        except ValueError as error:
            fail(str(error))
    result["model"], result["ar_model"] = str(diffusion.path), str(ar.path)
    if write:
        result["written_to"] = str(write_calibration(diffusion.path, result))
    if as_json:
        print(json.dumps(result))
        return
    console.print(f"diffusion field accuracy {result['fast_field_accuracy']:.3f}, AR {result['ar_field_accuracy']:.3f} "
                  f"on {n} {split} documents ({'schema template' if structured else 'free-form'})", highlight=False)
    if result["reached"]:
        console.print(f"threshold {result['confidence_threshold']:.4g}: {result['acceptance_rate']:.0%} of answers "
                      f"stay on diffusion at field accuracy {result['accepted_field_accuracy']:.3f} (target "
                      f"{result['target_field_accuracy']:.3f}); routed accuracy {result['routed_field_accuracy']:.3f}",
                      highlight=False)
    else:
        console.print(f"no threshold reaches field accuracy {result['target_field_accuracy']:.3f}: every answer "
                      f"falls back (threshold {result['confidence_threshold']:.4g})", highlight=False)
    kinds = ", ".join(f"{kind} {entry['confidence_threshold']:.4g}" for kind, entry in result["per_kind"].items())
    aurocs = ", ".join(f"{engine} {'n/a' if value is None else f'{value:.3f}'}"
                       for engine, value in result["discrimination"].items())
    console.print(f"per kind (and its schema): {kinds}; AUROC of confidence against a wrong field: {aurocs}",
                  highlight=False)
    if write:
        console.print(f"written to {result['written_to']}; `nowait serve` uses it when routing.confidence_threshold "
                      "is not set", highlight=False)


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
    loaded = _load_model(model or engine)
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
