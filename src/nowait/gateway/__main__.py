"""`python -m nowait.gateway [--config nowait.yaml] [--port N]`: the gateway without the full CLI."""

import typer

from nowait.gateway.cli import register

app = typer.Typer(add_completion=False)
register(app)

if __name__ == "__main__":
    app()
