"""`nowait demo`: the routing rule at work on a mixed workload, through the gateway's HTTP API."""
