"""`nowait bench`: measurements printed side by side from one run (never timed assertions).

Importing the package registers every bench command on `bench_app` (bench/app.py).
"""

from __future__ import annotations

from nowait.bench import batching, cache_modes, engines, peers, physics  # noqa: F401 (their commands register on import)
from nowait.bench.app import bench_app
from nowait.bench.gateway import register as register_gateway_bench
from nowait.bench.load import register as register_load_bench
from nowait.bench.soak import register as register_soak_bench

register_gateway_bench(bench_app)
register_load_bench(bench_app)
register_soak_bench(bench_app)

__all__ = ["bench_app"]
