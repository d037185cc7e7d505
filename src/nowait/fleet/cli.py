"""`nowait fleet up CONFIG`, `nowait fleet status [--json]`, `nowait fleet down`.

Ray is imported when a command runs, never with the CLI: `nowait serve` and `nowait demo` run
without the `fleet` extra installed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer

from nowait.fleet.cluster import FleetError, FleetState, clear_state, load_state, save_state

fleet_app = typer.Typer(help="nowait on a Ray Serve cluster: many GPUs and nodes (docs/fleet.md).",
                        no_args_is_help=True)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _connect(address: str) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        _fail('Ray is not installed: pip install -e ".[fleet]"')
    # `ray start` turns token authentication on when a token exists (~/.ray/auth_token); a driver
    # connecting does not by itself, and would be refused by the cluster it just started.
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    try:
        ray.init(address=address, namespace="nowait", log_to_driver=False, logging_level=logging.WARNING)
    except Exception as error:  # ConnectionError, or Ray's own on a wrong address
        _fail(f"cannot reach the Ray cluster at {address}: {error}")


@fleet_app.command("up")
def up(config: Path = typer.Argument(..., help="nowait.yaml: engines (with their `fleet` sections), fleet, store"),
       num_cpus: float = typer.Option(None, help="a local cluster's CPUs (default: Ray's, every core)"),
       num_gpus: float = typer.Option(None, help="a local cluster's GPUs (default: Ray's, those it finds)"),
       skip_model_check: bool = typer.Option(False, "--skip-model-check",
                                             help="the checkpoints are not on this machine (only on the cluster's "
                                                  "nodes): do not check them here")) -> None:
    """Deploy the gateway and every owned engine as a Ray Serve application; returns once it serves."""
    from nowait.gateway.config import ConfigError, load_config

    try:
        settings = load_config(config)
    except ConfigError as error:
        _fail(str(error))
    if load_state() is not None:
        _fail("a fleet is already up (`nowait fleet down` first)")
    if not skip_model_check:  # before any Ray process: a wrong path is one line, not a replica restarting
        from nowait.fleet.preflight import checkpoint_problems

        problems = checkpoint_problems(settings)
        if problems:
            _fail("; ".join(problems))
    marker = None
    address = settings.fleet.ray_address
    if address is None:
        from nowait.fleet.cluster import start_local_cluster

        try:
            address, marker = start_local_cluster(num_cpus, num_gpus, settings.fleet.worker_niceness)
        except FleetError as error:
            _fail(str(error))
    try:
        _connect(address)
        from nowait.fleet.deploy import deploy

        try:
            url = deploy(settings)
        except Exception as error:  # a replica that cannot start (its model missing, too few resources)
            _fail(f"the fleet did not start: {error}")
    except typer.Exit:
        if marker is not None:  # a failed `up` leaves no cluster behind
            from nowait.fleet.cluster import stop_local_cluster

            stop_local_cluster(marker)
        raise
    save_state(FleetState(address=address, url=url, local_cluster=marker))
    typer.echo(f"nowait fleet serving at {url} (Ray cluster {address}{', local' if marker else ''})")
    from nowait.fleet.deploy import fleet_status

    try:
        niced = niced_replicas(fleet_status(), settings.fleet.worker_niceness)
    except Exception:  # the fleet serves: a status that could not be read now is no reason to fail `up`
        niced = {}
    if niced:  # a cluster started elsewhere, with Ray's default: say so once, here, not per request
        wanted = settings.fleet.worker_niceness
        typer.echo(f"warning: {len(niced)} engine replica(s) run at niceness {max(niced.values())} "
                   f"(fleet.worker_niceness is {wanted}): start that cluster's nodes with "
                   f"RAY_worker_niceness={wanted} in the environment of `ray start` (docs/fleet.md)", err=True)


def niced_replicas(report: dict, wanted: int) -> dict[str, int]:
    """Engine replicas (by id) whose process runs at a niceness above `wanted`."""
    return {r["id"]: r["niceness"] for engine in report["engines"] for r in engine["replicas"]
            if r.get("niceness") is not None and r["niceness"] > wanted}


@fleet_app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="one JSON object")) -> None:
    """Each engine's replicas (node, pid, state, running, waiting, niceness), the gateway replicas and the URL."""
    state = load_state()
    if state is None:
        _fail("no fleet is up (`nowait fleet up CONFIG`)")
    _connect(state.address)
    from nowait.fleet.deploy import fleet_status

    report = fleet_status()
    if as_json:
        typer.echo(json.dumps(report))
        return
    typer.echo(f"{report['url']}  gateway replicas: {report['gateway_replicas']}")
    for engine in report["engines"]:
        typer.echo(f"engine {engine['name']}: {len(engine['replicas'])} replica(s)")
        for r in engine["replicas"]:
            typer.echo(f"  {r['id']}  {r['state']:<9} pid {r['pid']}  running {r['running']}  waiting {r['waiting']}"
                       f"  nice {r['niceness']}  node {str(r['node'])[:12]}")


@fleet_app.command("down")
def down() -> None:
    """Delete the application and stop Serve; a local cluster `fleet up` started is stopped too."""
    state = load_state()
    if state is None:
        _fail("no fleet is up")
    if state.local_cluster is None:  # someone else's cluster: leave it running, without nowait
        _connect(state.address)
        from nowait.fleet.deploy import shut_down

        shut_down()
    else:
        from nowait.fleet.cluster import stop_local_cluster

        left = stop_local_cluster(state.local_cluster)
        if left:
            _fail(f"Ray processes still running after SIGKILL: {left}")
    clear_state()
    typer.echo("nowait fleet is down")


def register(app: typer.Typer) -> None:
    """Add `fleet` to the nowait CLI."""
    app.add_typer(fleet_app, name="fleet")
