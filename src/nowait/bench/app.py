"""The `nowait bench` Typer group the bench commands register on.

Its own module so the command modules can import it while the package imports them (a group
defined in the package's `__init__` would make each command module and the package import each
other).
"""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Measure engines, batching and the gateway on this machine.", no_args_is_help=True)
