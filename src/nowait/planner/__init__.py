"""The planner: for our workloads, on our hardware, what should run where, on how many nodes, at what cost.

    hardware     accelerators and nodes, each figure with its source and date; `measure_host`
    roofline     FLOPs and bytes of a forward (from `nowait.model`), time bound, tensor parallelism, MoE
    engines      AR, speculative and diffusion serving as step models
    capacity     discrete-event simulation of Poisson arrivals; the smallest fleet that holds a p99 target
    cost         cost per token = node cost per hour / (throughput x utilization); break-even; sensitivity
    profile      measured step times (`--profile`) fitted in place of the roofline
    scenario     the YAML scenario as pydantic models
    fleets       the owned engines as serving models at any batch cap (roofline or measured step times)
    engine_plan  one engine for one workload: the cheapest fleet holding the p99 target, the fallback folded in
    plan         scenario -> plan (routes each workload with `nowait.router`)
    report       Markdown and PNG plots
    cli          `nowait plan`

docs/planner.md gives every formula with its source.
"""

from nowait.planner.plan import Plan, make_plan, to_json
from nowait.planner.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = ["Plan", "Scenario", "ScenarioError", "load_scenario", "make_plan", "parse_scenario", "to_json"]
