"""nowait on Ray Serve (`nowait fleet up|status|down`, docs/fleet.md): the gateway as the ingress
deployment, each owned engine a deployment of replicas built by the one engine factory.

    replica.py   EngineReplica: one engine replica (an OwnedBackend in a Ray actor)
    backend.py   FleetBackend: the gateway's Backend over a deployment handle (retry on a lost replica)
    router.py    NowaitRequestRouter: least loaded replica, prefix affinity for AR
    ingress.py   GatewayIngress: the same FastAPI app as `nowait serve`, its owned engines as FleetBackends
    deploy.py    the Serve application from a config; up, status, down
    cli.py       the `nowait fleet` commands

Ray is an optional extra (`pip install -e ".[fleet]"`): nothing outside this package imports it,
and the CLI imports this package's Ray modules only when a `fleet` command runs.
"""
