"""Shared by the planner's CLI tests: `nowait plan` registered on an app of its own."""

from __future__ import annotations

import typer

from nowait.planner.cli import register


def planner_app() -> typer.Typer:
    """A Typer app with only `plan` on it, so the planner's CLI is tested without the whole `nowait` app."""
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """A stand-in for the main app."""

    register(app)
    return app
