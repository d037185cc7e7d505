"""`nowait bench engines`: every engine configuration on the same test documents, batch size 1.

One process, one run: each entry decodes the same documents one at a time and reports the eval
fields (accuracy, validity, forwards per document, tokens per forward, latency p50/p95); the
latency and accuracy ratios against the diffusion fast default are printed beside them. The
numbers are measurements, never assertions.

Entries live in a registry (name -> function of a `BenchContext` returning the entry's eval
fields), so other engines add theirs with `register_entry` without touching this command.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import typer

from nowait.bench.app import bench_app
from nowait.corpus_tiers import TIER_HELP, check_tier

if TYPE_CHECKING:  # torch and the engines load when the command runs, not with the CLI
    from nowait.bench.step_floor import ForwardRecorder
    from nowait.checkpoints import LoadedModel
    from nowait.engines.factory import ModelCache
    from nowait.extraction.corpus import Document

DEFAULT_ENTRIES = ("ar", "spec", "ar-structured", "diffusion-reference", "diffusion", "diffusion-structured")
BASELINE = "diffusion"  # the ratios compare every entry with the diffusion fast default


class BenchError(ValueError):
    """A bench that cannot run (a missing model, an unknown entry): one clear line."""


@dataclass
class BenchContext:
    """What entries share: the documents, and the models by role, loaded once on first use."""

    docs: list[Document]
    model_paths: dict[str, str] = field(default_factory=dict)  # role (ar, diffusion, draft) -> dir
    device: str = "cpu"
    tier: str = "clean"  # the corpus tier `docs` were drawn from
    # Every checkpoint loaded once, by the entries and by the engines the routed entry builds.
    models: ModelCache | None = None
    _loaded: dict[str, LoadedModel] = field(default_factory=dict)
    # role -> the forwards of its model (nowait.bench.step_floor), for each entry's compute floor
    recorders: dict[str, ForwardRecorder] = field(default_factory=dict)

    def model(self, role: str) -> LoadedModel:
        """The model for a role: `model_paths[role]` or the bundled demo model of that name,
        loaded as the engine factory loads the models a config names."""
        from nowait.checkpoints import CheckpointError
        from nowait.engines.factory import ModelCache

        if self.models is None:
            self.models = ModelCache()
        if role not in self._loaded:
            try:
                self._loaded[role] = self.models.load(self.model_paths.get(role) or role, device=self.device)
            except CheckpointError as error:
                raise BenchError(f"{role} model: {error}") from None
            from nowait.bench.step_floor import ForwardRecorder
            from nowait.model import Transformer

            if isinstance(self._loaded[role].model, Transformer):
                self.recorders[role] = ForwardRecorder(self._loaded[role].model)
        return self._loaded[role]

    def optional_model(self, role: str) -> LoadedModel | None:
        try:
            return self.model(role)
        except BenchError:
            return None


BenchEntry = Callable[[BenchContext], dict]
ENTRIES: dict[str, BenchEntry] = {}
# entry -> the role whose model's forwards are that entry's steps (its compute floor). Entries that
# drive one model through several engines taking turns (spec, fallback) have none: their steps mix.
FLOOR_ROLES: dict[str, str] = {}


def register_entry(name: str, floor_role: str | None = None) -> Callable[[BenchEntry], BenchEntry]:
    """Add an entry: a function of the context returning its eval fields (at least those of
    `nowait eval`: field_accuracy, forwards_per_doc, tokens_per_forward, latency_ms_p50/p95;
    `latency_ms_mean` too for a step time). `floor_role`: the model role whose forwards are the
    entry's steps, for `step_ms` beside `compute_floor_ms`."""
    def add(entry: BenchEntry) -> BenchEntry:
        ENTRIES[name] = entry
        if floor_role:
            FLOOR_ROLES[name] = floor_role
        return entry
    return add


# --- the four configurations of issue 3 ---


def _diffusion(ctx: BenchContext, options, structured: bool = False) -> dict:
    from nowait.evaluation import describe_decoding, evaluate_engine

    loaded = ctx.model("diffusion")
    result = evaluate_engine(loaded.model, loaded.codec, "diffusion", ctx.docs, batch_size=1, diffusion=options,
                             structured=structured)
    return {**result, "decoding": describe_decoding("diffusion", options, structured)}


@register_entry("ar", floor_role="ar")
def ar_entry(ctx: BenchContext) -> dict:
    """Plain greedy AR decoding with the KV cache."""
    from nowait.evaluation import describe_decoding, evaluate_engine

    loaded = ctx.model("ar")
    result = evaluate_engine(loaded.model, loaded.codec, "ar", ctx.docs, batch_size=1)
    return {**result, "decoding": describe_decoding("ar", None, False)}


def reference_options():
    """LLaDA's reference schedule: one position per forward, blocks of 32, no cache."""
    from nowait.engines.diffusion.request import DiffusionOptions

    return DiffusionOptions(policy="fixed", steps=None, block=32, template_block=32, cache="none")


@register_entry("diffusion-reference", floor_role="diffusion")
def diffusion_reference_entry(ctx: BenchContext) -> dict:
    return _diffusion(ctx, reference_options())


@register_entry("diffusion", floor_role="diffusion")
def diffusion_entry(ctx: BenchContext) -> dict:
    """The engine's fast default, free-form JSON (like `ar`), and the same run taking turns
    with plain AR on each document (`vs_ar_interleaved`)."""
    from nowait.engines.diffusion.request import DiffusionOptions

    result = _diffusion(ctx, DiffusionOptions())
    if ctx.optional_model("ar") is not None:
        result["vs_ar_interleaved"] = interleaved_vs_ar(ctx, DiffusionOptions())
    return result


def interleaved_vs_ar(ctx: BenchContext, options) -> dict:
    """Plain AR and the diffusion engine decode each document back to back, taking turns, so
    a shared machine's changing load falls on both alike (the separate entries run minutes
    apart). p50 latencies of each and their ratio; the outputs are scored as in the entries."""
    import time

    import numpy as np

    from nowait.engines.ar import greedy_decode
    from nowait.engines.config import DiffusionEngineConfig
    from nowait.engines.factory import EngineModel, engine_from
    from nowait.evaluation import completion_metrics, document_request
    from nowait.extraction.scorer import score_document, summarize

    ar, diffusion = ctx.model("ar"), ctx.model("diffusion")
    engine = engine_from(DiffusionEngineConfig.with_options(options, max_batch=1),
                         EngineModel(diffusion.model, diffusion.codec))
    ar_ms, ar_texts, completions = [], [], []
    for doc in ctx.docs:
        request = document_request(doc, ar.codec)
        started = time.perf_counter()
        output = greedy_decode(ar.model.eval(), [request.prompt_ids], request.sampling.max_tokens, ar.codec.end_id)[0]
        ar_ms.append((time.perf_counter() - started) * 1000)
        ar_texts.append(ar.codec.decode(output))
        completions += engine.generate([document_request(doc, diffusion.codec)])
    ar_accuracy = summarize(score_document(t, d.fields, d.kind) for t, d in zip(ar_texts, ctx.docs, strict=True))
    decoded = completion_metrics(completions, ctx.docs)
    ar_p50, diffusion_p50 = float(np.percentile(ar_ms, 50)), decoded["latency_ms_p50"]
    return {"ar_latency_ms_p50": round(ar_p50, 2), "diffusion_latency_ms_p50": round(diffusion_p50, 2),
            "speedup_p50_vs_ar": round(ar_p50 / max(diffusion_p50, 1e-9), 3),
            "ar_field_accuracy": ar_accuracy["field_accuracy"], "diffusion_field_accuracy": decoded["field_accuracy"]}


@register_entry("diffusion-structured", floor_role="diffusion")
def diffusion_structured_entry(ctx: BenchContext) -> dict:
    """The fast default filling each document kind's JSON Schema template."""
    from nowait.engines.diffusion.request import DiffusionOptions

    return _diffusion(ctx, DiffusionOptions(), structured=True)


@register_entry("spec")
def spec_bench_entry(ctx: BenchContext) -> dict:
    """AR + the best speculative method at batch size 1 (diffusion drafter, hybrid, draft
    model, prompt lookup)."""
    from nowait.bench.ar_entries import spec_entry
    from nowait.engines.speculative import check_draft, check_drafter_model

    loaded = ctx.model("ar")
    draft, draft_refused = _spec_helper(ctx, loaded, "draft", check_draft)
    drafter, drafter_refused = _spec_helper(ctx, loaded, "diffusion", check_drafter_model)
    entry = spec_entry(loaded.model, loaded.codec, ctx.docs, draft=draft.model if draft else None,
                       draft_codec=draft.codec if draft else None, drafter=drafter.model if drafter else None,
                       drafter_codec=drafter.codec if drafter else None)
    if draft_refused:
        entry["draft_refused"] = draft_refused
    if drafter_refused:
        entry["drafter_refused"] = drafter_refused
    return entry


def _spec_helper(ctx: BenchContext, target: LoadedModel, role: str,
                 check: Callable) -> tuple[LoadedModel | None, str | None]:
    """The draft (role "draft") or diffusion drafter (role "diffusion") for the `spec` entry,
    or None and why not.

    A model named with --draft-model / --diffusion-model must fit the target (else BenchError).
    A bundled one is tried only with the bundled AR model, and when its tokenizer no longer
    matches (the AR model was retrained with a new tokenizer and it not yet) it is left out with
    the reason: the methods that need it are skipped, prompt lookup still runs.
    """
    from nowait.engines.speculative import IncompatibleDraftError

    named = bool(ctx.model_paths.get(role))
    if named:
        helper = ctx.model(role)
    elif not ctx.model_paths.get("ar"):
        helper = ctx.optional_model(role)
    else:
        return None, None
    if helper is None:
        return None, None
    try:
        check(target.model, helper.model, target.codec, helper.codec)
    except IncompatibleDraftError as error:
        if named:
            raise BenchError(f"{role} model {helper.path}: {error}") from None
        return None, f"{helper.path}: {error}"
    return helper, None


@register_entry("fallback")
def fallback_bench_entry(ctx: BenchContext) -> dict:
    """A diffusion answer re-run on AR: decoded from scratch, or verified as a draft (not in the
    default entries: `--only fallback`)."""
    from nowait.bench.ar_entries import fallback_entry
    from nowait.engines.speculative import check_draft, check_drafter_model

    loaded = ctx.model("ar")
    drafter, refused = _spec_helper(ctx, loaded, "diffusion", check_drafter_model)
    if drafter is None:
        raise BenchError(f"the fallback entry needs a diffusion model with the AR model's tokenizer ({refused})")
    draft, _ = _spec_helper(ctx, loaded, "draft", check_draft)
    return fallback_entry(loaded.model, loaded.codec, ctx.docs, drafter.model, drafter.codec,
                          draft.model if draft else None, draft.codec if draft else None)


@register_entry("routed")
def routed_bench_entry(ctx: BenchContext) -> dict:
    """Diffusion with the gateway's fallback rule and thresholds, one document at a time, as
    `nowait eval --engine routed` runs it (nowait.routed_eval) on the bench's documents and
    models (not in the default entries: `--only routed`)."""
    from nowait.gateway.config import default_config
    from nowait.routed_eval import evaluate_route, routed_config

    # Loaded here first so that a missing model is a BenchError naming its role, and so that the
    # route's engines take these weights from ctx.models.
    ctx.model("diffusion")
    ctx.model("ar")
    config = routed_config(default_config(), ctx.model_paths.get("diffusion") or "diffusion",
                           ctx.model_paths.get("ar") or "ar", None if ctx.device == "cpu" else ctx.device)
    result = evaluate_route(config, ctx.docs, ctx.tier, models=ctx.models)
    settings = result.pop("settings")
    return {**result, "decoding": settings["decoding"], "routed_settings": settings}


@register_entry("ar-structured", floor_role="ar")
def ar_structured_bench_entry(ctx: BenchContext) -> dict:
    """Greedy AR constrained by each kind's JSON Schema grammar, batch size 1."""
    from nowait.bench.ar_entries import ar_structured_entry

    loaded = ctx.model("ar")
    return ar_structured_entry(loaded.model, loaded.codec, ctx.docs)


# --- running and reporting ---


def ratios(entries: list[dict], baseline: str = BASELINE) -> dict[str, dict[str, float]]:
    """p50 latency of each entry over the baseline's (how many times faster the baseline is),
    and each entry's field accuracy over the baseline's."""
    by_name = {e["name"]: e for e in entries}
    base = by_name.get(baseline)
    if base is None:
        return {"latency_p50": {}, "field_accuracy": {}}
    latency, accuracy = {}, {}
    for name, entry in by_name.items():
        if name == baseline:
            continue
        if base["latency_ms_p50"] > 0:
            latency[f"{name}/{baseline}"] = round(entry["latency_ms_p50"] / base["latency_ms_p50"], 3)
        if entry["field_accuracy"] > 0:
            accuracy[f"{baseline}/{name}"] = round(base["field_accuracy"] / entry["field_accuracy"], 4)
    return {"latency_p50": latency, "field_accuracy": accuracy}


def entry_floor(entry: dict, recorder: ForwardRecorder | None, peak_flops: float) -> dict:
    """`step_ms`: the entry's mean latency per document over its forwards per document (each
    step's share of the engine's own work included); `compute_floor_ms`: the mean FLOPs of the
    forwards its model ran during the entry over the peak (nowait.bench.step_floor)."""
    from nowait.bench.step_floor import step_floor

    forwards, mean_ms = entry.get("forwards_per_doc") or 0, entry.get("latency_ms_mean")
    step_s = mean_ms / 1000 / forwards if forwards and mean_ms else None
    flops = recorder.flops() / recorder.calls if recorder is not None and recorder.calls else None
    return step_floor(step_s, flops if step_s else None, peak_flops)


def run_bench(ctx: BenchContext, names: list[str], progress: Callable[[str], None] | None = None,
              peak_flops: float | None = None) -> dict:
    """Every entry in turn; with `peak_flops`, each entry's step time beside its compute floor."""
    unknown = [n for n in names if n not in ENTRIES]
    if unknown:
        raise BenchError(f"unknown entr{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                         f"registered: {', '.join(ENTRIES)}")
    entries = []
    for name in names:
        if progress:
            progress(name)
        for recorder in ctx.recorders.values():
            recorder.records.clear()  # each entry's forwards alone
        entry = {"name": name, **ENTRIES[name](ctx)}
        if peak_flops:
            role = FLOOR_ROLES.get(name)
            entry.update(entry_floor(entry, ctx.recorders.get(role) if role else None, peak_flops))
        entries.append(entry)
    report = {"engines": entries, "ratios": ratios(entries), "n": len(ctx.docs)}
    if peak_flops:
        report["peak_flops"] = peak_flops
    return report


@bench_app.command("engines")
def engines(
    n: int = typer.Option(200, help="test documents, each decoded once per entry at batch size 1"),
    split: str = typer.Option("test", help="validation or test (ignored with --seed)"),
    seed: int = typer.Option(None, help="a fresh sample of the same distribution"),
    ar_model: str = typer.Option(None, help="AR checkpoint directory (default: the bundled ar model)"),
    diffusion_model: str = typer.Option(None, help="diffusion checkpoint directory (default: bundled diffusion)"),
    draft_model: str = typer.Option(None, help="draft checkpoint directory, for entries that use one"),
    only: str = typer.Option(None, help="comma-separated entries to run (default: "
                                        + ", ".join(DEFAULT_ENTRIES) + "; also: "
                                        + ", ".join(n for n in ENTRIES if n not in DEFAULT_ENTRIES) + ")"),
    threads: int = typer.Option(None, min=1, help="CPU threads (default: torch's choice)"),
    shape: str = typer.Option(None, help="time batch-1 engine steps of a real model shape with random weights "
                                         "instead: qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b, llada-8b, dream-7b, "
                                         "diffusiongemma-26b-a4b (its denoiser step)"),
    dtype: str = typer.Option("fp32", help="with --shape: fp32 or bf16"),
    tokens_per_step: float = typer.Option(2.0, help="with --shape: tokens a diffusion step commits (fixed policy)"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N"),
    host_budget: float = typer.Option(1.0, min=0.01, help="seconds to measure the matmul peak each entry's "
                                                          "compute floor is read against"),
    tier: str = typer.Option("clean", help=TIER_HELP),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Latency, forwards and accuracy of AR and the diffusion configurations, same documents.

    Entries: plain AR (KV cache), AR with the best speculative method, grammar-constrained AR,
    the reference diffusion schedule (one token per forward, no cache), the diffusion fast
    default, and the fast default filling schema templates."""
    from rich.console import Console

    from nowait.cli_errors import fail

    if n < 1:
        fail("--n must be at least 1")
    if seed is None and split not in ("validation", "test"):
        fail(f"unknown split {split!r}; choose validation or test (or give --seed)")
    try:
        check_tier(tier)
    except ValueError as error:
        fail(str(error))
    import torch

    if threads:
        torch.set_num_threads(threads)
    if shape:
        from nowait.bench.shape_command import run_shape_command
        from nowait.bench.shapes import shape_cases

        run_shape_command(shape, shape_cases((1,), (1,), tokens_per_step), dtype, device, 1.0, as_json)
        return
    from nowait.checkpoints import check_device

    try:
        check_device(device)
    except ValueError as error:
        fail(str(error))
    names = [name.strip() for name in only.split(",") if name.strip()] if only else list(DEFAULT_ENTRIES)
    from nowait.extraction.corpus import documents

    ctx = BenchContext(docs=documents(split, n, seed=seed, tier=tier),
                       model_paths={"ar": ar_model, "diffusion": diffusion_model, "draft": draft_model}, device=device,
                       tier=tier)
    err = Console(stderr=True)
    from nowait.bench.step_floor import matmul_peak

    peak = matmul_peak(device, "fp32", host_budget)  # BenchContext loads every model in fp32
    try:
        report = run_bench(ctx, names, progress=None if as_json else lambda name: err.print(f"bench {name} ..."),
                           peak_flops=peak)
    except ValueError as error:
        fail(str(error))
    report["tier"] = tier
    report["settings"] = {"split": None if seed is not None else split, "seed": seed, "batch_size": 1,
                          "threads": torch.get_num_threads(), "device": device,
                          "models": {role: str(loaded.path) for role, loaded in ctx._loaded.items()}}
    if as_json:
        print(json.dumps(report))
        return
    _print_table(report)


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"nowait bench engines (n={report['n']}, tier {report['tier']}, batch size 1)")
    table.add_column("engine", no_wrap=True)
    for column in ("field acc", "doc acc", "valid", "fwd/doc", "tok/fwd", "p50 ms", "p95 ms", "step ms",
                   "floor ms", "overhead"):
        table.add_column(column, justify="right")

    def shown(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    for e in report["engines"]:
        table.add_row(e["name"], f"{e['field_accuracy']:.3f}", f"{e.get('doc_accuracy', 0):.3f}",
                      f"{e.get('json_valid_rate', 0):.3f}", f"{e['forwards_per_doc']:.1f}",
                      f"{e['tokens_per_forward']:.2f}", f"{e['latency_ms_p50']:.1f}", f"{e['latency_ms_p95']:.1f}",
                      shown(e.get("step_ms"), ".3f"), shown(e.get("compute_floor_ms"), ".4f"),
                      shown(e.get("overhead_share"), ".1%"))
    console = Console()
    console.print(table)
    for e in report["engines"]:
        if e.get("draft_refused"):
            console.print(f"{e['name']}: draft left out ({e['draft_refused']}); methods draft and hybrid skipped",
                          highlight=False)
        if e.get("drafter_refused"):
            console.print(f"{e['name']}: diffusion drafter left out ({e['drafter_refused']}); method diffusion "
                          "skipped", highlight=False)
    for e in report["engines"]:
        for verifier, m in (e.get("verifiers") or {}).items():
            console.print(f"{e['name']}: a diffusion answer verified by {verifier} ({m['answer_gamma']} tokens a "
                          f"verify) in "
                          f"{m['latency_ms_p50']:.1f} ms p50 vs {e['ar']['latency_ms_p50']:.1f} ms decoded by AR "
                          f"({m['speedup_p50_vs_ar']:.2f}x), greedy output identical to AR: "
                          f"{m['greedy_identical_to_ar']}", highlight=False)
        for method, m in (e.get("methods") or {}).items():
            console.print(f"{e['name']} {method}: p50 {m['latency_ms_p50']:.1f} ms, {m['speedup_p50_vs_ar']:.2f}x "
                          f"vs the AR engine taking turns, acceptance {m.get('acceptance_rate') or 0:.2f}, greedy "
                          f"output identical to AR: {m['greedy_identical_to_ar']}", highlight=False)
    for e in report["engines"]:
        if "kept_on_diffusion" in e:
            r = e["routed_settings"]
            console.print(f"{e['name']}: {e['kept_on_diffusion']:.0%} kept on diffusion (threshold "
                          f"{r['confidence_threshold']:.4g}, {r['confidence_threshold_source']}), field accuracy "
                          f"{e['field_accuracy']:.3f} (diffusion alone {e['diffusion_field_accuracy']:.3f}), "
                          f"${e['usd_per_request']:.4f} per request, {e['low_confidence_flags']} low-confidence "
                          "flags", highlight=False)
        if e.get("vs_ar_interleaved"):
            h = e["vs_ar_interleaved"]
            console.print(f"{e['name']} vs ar, taking turns on each document: p50 {h['diffusion_latency_ms_p50']:.1f} "
                          f"vs {h['ar_latency_ms_p50']:.1f} ms ({h['speedup_p50_vs_ar']:.2f}x), field accuracy "
                          f"{h['diffusion_field_accuracy']:.3f} vs {h['ar_field_accuracy']:.3f}", highlight=False)
    for kind, values in report["ratios"].items():
        if values:
            console.print(f"{kind}: " + ", ".join(f"{k} {v}" for k, v in values.items()), highlight=False)
