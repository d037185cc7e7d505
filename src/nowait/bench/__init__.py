"""`nowait bench`: measurements printed side by side from one run (never timed assertions)."""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Measure engines, batching and the gateway on this machine.", no_args_is_help=True)

# Commands register themselves on bench_app when their module is imported.
from nowait.bench import batching, cache_modes, engines, physics  # noqa: E402, F401
from nowait.bench.gateway import register as register_gateway_bench  # noqa: E402

register_gateway_bench(bench_app)
from nowait.bench.load import register as register_load_bench  # noqa: E402

register_load_bench(bench_app)
