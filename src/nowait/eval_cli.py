"""`nowait eval` and `nowait calibrate`: an engine (or the routed real-time path) scored on
held-out documents, and the fallback threshold chosen on them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from nowait import paths
from nowait.cli_errors import fail
from nowait.corpus_tiers import TIER_HELP

if TYPE_CHECKING:  # torch and the engines load when a command runs, not with the CLI
    from nowait.checkpoints import LoadedModel
    from nowait.engines.ar import AutoregressiveEngine
    from nowait.engines.factory import ModelCache

console = Console()
err_console = Console(stderr=True)
ROUTED = "routed"  # eval's engine for the gateway's real-time route: diffusion, falling back to AR


def load_model(model: str, device: str = "cpu", models: ModelCache | None = None) -> LoadedModel:
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


def evaluate(
    engine: str = typer.Option("ar", help="ar, spec (AR + speculative decoding), diffusion, or routed (diffusion "
                                          "with the gateway's fallback to AR, one document at a time)"),
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
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N"),
    tier: str = typer.Option("clean", help=TIER_HELP),
    config: Path = typer.Option(None, "--config", "-c", help="routed: a gateway config (its fast and fallback "
                                                            "engines, thresholds, floors and node prices)"),
    ar_model: str = typer.Option(None, help="routed: the fallback engine's checkpoint (default: the config's)"),
    threshold: float = typer.Option(None, help="routed: one fallback threshold for every request instead of the "
                                               "config's or the calibrated ones (above 1: every answer falls back)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Decode N held-out documents and score the JSON: accuracy, validity, forwards and latency."""
    import torch

    from nowait.engines.factory import ModelCache
    from nowait.engines.speculative import SPEC_METHODS
    from nowait.evaluation import ENGINES, check_engine, diffusion_options, run_engine_eval, run_eval

    if engine not in (*ENGINES, ROUTED):
        fail(f"unknown engine {engine!r}; choose one of: {', '.join((*ENGINES, ROUTED))}")
    if seed is None and split not in ("validation", "test"):
        fail(f"unknown split {split!r}; choose validation or test (or give --seed)")
    if n < 1:
        fail("--n must be at least 1")
    if batch_size < 1:
        fail("--batch-size must be at least 1")
    _check_tier(tier)
    diffusion_flags = {"--policy": policy, "--tau": tau, "--block": block, "--cache": cache, "--refresh": refresh,
                       "--cache-decoded": cache_decoded}
    routed_flags = {"--config": config, "--ar-model": ar_model, "--threshold": threshold}
    if engine == ROUTED:
        given = [flag for flag, value in {**diffusion_flags, "--gamma": gamma, "--draft": draft}.items()
                 if value is not None]
        if given:
            fail(f"{', '.join(given)} do not apply to --engine routed: its engines are the config's (set diffusion "
                 "options under engines.<name>.options in --config)")
        if threshold is not None and threshold < 0:
            fail(f"--threshold must be at least 0, got {threshold:g}")
        if threads:
            torch.set_num_threads(threads)
        _evaluate_routed(config, model, ar_model, threshold, n, split, seed, tier, structured, device, as_json)
        return
    given = [flag for flag, value in routed_flags.items() if value is not None]
    if given:
        fail(f"{', '.join(given)} apply to --engine routed only")
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
    if threads:
        torch.set_num_threads(threads)
    models = ModelCache()
    loaded = load_model(model or ("ar" if engine == "spec" else engine), device, models)
    try:
        check_engine(loaded.model, engine)
    except ValueError as error:
        fail(str(error))
    serving = None
    if engine == "spec" or (engine == "ar" and structured):
        # Built before the progress bar, so a refused draft is one clear line.
        serving = _serving_engine(models, loaded, engine, batch_size, structured, method, gamma, draft, device)
    columns = [TextColumn(f"[bold]eval {engine}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=err_console, transient=as_json) as progress:
        task = progress.add_task("eval", total=n)
        advance = lambda k: progress.advance(task, k)  # noqa: E731
        try:
            if serving is not None:
                # Speculation runs at batch size 1, where it pays; constrained AR batched.
                result = run_engine_eval(serving, loaded.codec, n, split, seed, structured,
                                         one_at_a_time=engine == "spec", on_batch=advance, tier=tier)
            else:
                result = run_eval(loaded.model, loaded.codec, engine, n, split=split, seed=seed,
                                  batch_size=batch_size, block=block, policy=policy, tau=tau, cache=cache,
                                  structured=structured, on_batch=advance, refresh=refresh,
                                  cache_decoded=cache_decoded, tier=tier)
        except ValueError as error:
            fail(str(error))
    result["settings"]["model"] = str(loaded.path)
    result["settings"]["device"] = device
    if as_json:
        print(json.dumps(result))
        return
    _print_eval_table(result)


def _check_tier(tier: str) -> None:
    from nowait.corpus_tiers import check_tier

    try:
        check_tier(tier)
    except ValueError as error:
        fail(str(error))


def _evaluate_routed(config_file: Path | None, model: str | None, ar_model: str | None, threshold: float | None,
                     n: int, split: str, seed: int | None, tier: str, structured: bool, device: str,
                     as_json: bool) -> None:
    """`eval --engine routed`: the config's fast engine with the gateway's fallback rule."""
    from nowait.gateway.config import ConfigError, default_config, load_config
    from nowait.routed_eval import routed_config, run_routed_eval

    try:
        base = load_config(config_file) if config_file is not None else default_config()
    except ConfigError as error:
        fail(str(error))
    from nowait.checkpoints import check_device

    try:
        check_device(device)  # before the progress bar and any weights
    except ValueError as error:
        fail(str(error))
    # --device moves both engines; left at cpu, the config's own devices hold.
    chosen = routed_config(base, model, ar_model, None if device == "cpu" else device)
    with Progress(TextColumn("[bold]eval routed"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=err_console, transient=as_json) as progress:
        task = progress.add_task("eval", total=n)
        try:
            result = run_routed_eval(chosen, n, split, seed, tier, structured, threshold,
                                     on_batch=lambda k: progress.advance(task, k))
        except ValueError as error:  # a checkpoint that cannot load, an engine of the wrong kind
            fail(str(error))
    result["settings"]["config"] = str(config_file) if config_file else None
    if as_json:
        print(json.dumps(result))
        return
    _print_eval_table(result)


def _serving_engine(models: ModelCache, loaded: LoadedModel, engine: str, batch_size: int, structured: bool,
                    method: str, gamma: int | None, draft: str | None, device: str = "cpu") -> AutoregressiveEngine:
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
                                max_num_batched_tokens=max(batch_size, EngineConfig.max_num_batched_tokens),
                                device=device)  # the weights `loaded` holds there, not a second copy
    else:
        config = SpecEngineConfig(kind="spec", model=target, method=method, draft=draft, gamma=gamma, max_num_seqs=1,
                                  structured=structured, device=device)
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
    rows = ([(kind, m) for kind, m in result["per_kind"].items()] + [("all", result)]
            + [(f"tier {tier}", m) for tier, m in result.get("per_tier", {}).items()])
    for kind, m in rows:
        table.add_row(kind, str(m["n"]), f"{m['field_accuracy']:.3f}", f"{m['present_field_accuracy']:.3f}",
                      f"{m['doc_accuracy']:.3f}", f"{m['json_valid_rate']:.3f}")
    console.print(table)
    if result["settings"]["engine"] == ROUTED:
        console.print(f"{result['settings']['decoding']}; {result['elapsed_s']} s; kept on diffusion "
                      f"{result['kept_on_diffusion']:.0%} (diffusion alone: field acc "
                      f"{result['diffusion_field_accuracy']:.3f}); latency p50 {result['latency_ms_p50']} ms, p95 "
                      f"{result['latency_ms_p95']} ms; ${result['usd_per_request']:.2e} per request; "
                      f"{result['low_confidence_flags']} low-confidence flag(s)", highlight=False)
        for tier, entry in [("", result), *((f", tier {t}", m) for t, m in result.get("per_tier", {}).items())]:
            _print_low_confidence_table(entry["low_confidence"], f"low-confidence flags{tier} (n={entry['n']})")
        return
    console.print(f"{result['settings']['decoding']}; {result['elapsed_s']} s; "
                  f"{result['forwards_per_doc']} forwards/doc, {result['tokens_per_forward']} tokens/forward, "
                  f"latency p50 {result['latency_ms_p50']} ms, p95 {result['latency_ms_p95']} ms", highlight=False)


def _print_low_confidence_table(report: dict, title: str) -> None:
    """Recall (wrong answers flagged) and false flags (correct answers flagged) per engine and
    floor, and (eval --engine routed) for the answers as returned (`low_confidence` of the JSON)."""
    from rich.table import Table

    def rate(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0%}"

    goal = report["goal"]
    table = Table(title=f"{title}; goal: recall >= {goal['recall_at_least']:.0%}, false flags <= "
                        f"{goal['false_flag_rate_at_most']:.0%}")
    for column in ("answers", "floor", "wrong flagged", "recall", "correct flagged", "false flags", "goal"):
        table.add_column(column, justify="left" if column == "answers" else "right")
    returned = {"returned": report["routed"]} if "routed" in report else {}
    for name, group in {**report["engines"], **returned}.items():
        label = f"{name} (n={group['n']})"
        for floor, e in [("default", group["at_floor"]), *((f"{r['floor']:g}", r) for r in group["sweep"])]:
            table.add_row(label, floor, f"{e['wrong_flagged']}/{e['wrong']}", rate(e["recall"]),
                          f"{e['correct_flagged']}/{e['correct']}", rate(e["false_flag_rate"]),
                          {True: "met", False: "", None: "n/a"}[e["meets_goal"]])
            label = ""
        table.add_section()
    console.print(table)
    console.print("default: each engine's engines.<name>.confidence_floor", highlight=False)


def calibrate(
    model: str = typer.Option("diffusion", help="the diffusion model to calibrate (bundled name or checkpoint path)"),
    ar_model: str = typer.Option("ar", help="the AR model answers fall back to (its accuracy is the default target)"),
    n: int = typer.Option(200, help="held-out documents to decode"),
    split: str = typer.Option("validation", help="validation or test (ignored with --seed)"),
    seed: int = typer.Option(None, help="a fresh sample of the same distribution, never seen in training"),
    target: float = typer.Option(None, help="field accuracy the kept diffusion answers must reach (default: the AR "
                                            "model's on the same documents)"),
    structured: bool = typer.Option(True, "--structured/--free-form", help="schema-template answers (the "
                                    "real-time extraction route) or free-form ones"),
    batch_size: int = typer.Option(8),
    write: bool = typer.Option(True, "--write/--no-write", help="write calibration.json beside the model"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice)"),
    tier: str = typer.Option("clean", help=TIER_HELP),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N (both models)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Choose the confidence threshold below which diffusion answers fall back to AR, on held-out data."""
    import torch

    from nowait.calibration import calibrate as run_calibration
    from nowait.calibration import write_calibration
    from nowait.engines.factory import ModelCache
    from nowait.evaluation import check_engine

    if seed is None and split not in ("validation", "test"):
        fail(f"unknown split {split!r}; choose validation or test (or give --seed)")
    if seed is None and split == "test" and write:
        # The written threshold is what serving and the benchmarks then use: chosen on test
        # documents, those documents would no longer be held out.
        fail("--split test chooses a threshold on the documents the benchmarks score: add --no-write to look only")
    if n < 1 or batch_size < 1:
        fail("--n and --batch-size must be at least 1")
    if target is not None and not 0 < target <= 1:
        fail(f"--target must be in (0, 1], got {target}")
    _check_tier(tier)
    if threads:
        torch.set_num_threads(threads)
    models = ModelCache()
    diffusion, ar = load_model(model, device, models), load_model(ar_model, device, models)
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
                                     batch_size, on_batch=lambda k: progress.advance(task, k), tier=tier,
                                     seed=seed)
        except ValueError as error:
            fail(str(error))
    result["model"], result["ar_model"], result["device"] = str(diffusion.path), str(ar.path), device
    if write:
        result["written_to"] = str(write_calibration(diffusion.path, result))
    if as_json:
        print(json.dumps(result))
        return
    source = split if seed is None else f"seed {seed}"
    console.print(f"diffusion field accuracy {result['fast_field_accuracy']:.3f}, AR {result['ar_field_accuracy']:.3f} "
                  f"on {n} {source} documents, tier {tier} ({'schema template' if structured else 'free-form'})",
                  highlight=False)
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
    for name, entry in result.get("per_tier", {}).items():
        console.print(f"tier {name}: diffusion {entry['fast_field_accuracy']:.3f}, AR "
                      f"{entry['ar_field_accuracy']:.3f}, {entry['acceptance_rate']:.0%} kept on diffusion at the "
                      "threshold", highlight=False)
    for name, entry in [("", result), *((f", tier {t}", m) for t, m in result.get("per_tier", {}).items())]:
        _print_low_confidence_table(entry["low_confidence"], f"low-confidence flags{name} (n={entry['n']})")
    if write:
        console.print(f"written to {result['written_to']}; `nowait serve` uses it when routing.confidence_threshold "
                      "is not set", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `eval` and `calibrate` to the nowait CLI."""
    app.command("eval")(evaluate)
    app.command("calibrate")(calibrate)
