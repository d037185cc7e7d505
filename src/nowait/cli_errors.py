"""How a command stops on a caller's mistake: one line on stderr, exit status 2, no traceback.

Its own module so that the commands registered on the main app (bench, demo, ...) can stop the
same way without importing the app that imports them.
"""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """One clear line on stderr and a non-zero exit; no traceback."""
    typer.echo(f"error: {message}", err=True)  # plain: a wrapped line is two lines to a script
    raise typer.Exit(code=2)
