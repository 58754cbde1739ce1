"""An OpenAI-compatible inference simulator with a scripted, deterministic model.

Tests, demos and benchmarks run against it over real HTTP: ``@sim`` directives in the task
text decide tool calls, answers and faults; a fixed-latency or GPU-like continuous-batching
scheduler decides timing; ``/metrics`` speaks vLLM's metric names.
"""

from agentbatch.sim.config import DEFAULT_MODEL, SimConfig, parse_fault_rates
from agentbatch.sim.process import SimProcess, free_port
from agentbatch.sim.server import SimServer, build_app, run_sim

__all__ = [
    "DEFAULT_MODEL",
    "SimConfig",
    "SimProcess",
    "SimServer",
    "build_app",
    "free_port",
    "parse_fault_rates",
    "run_sim",
]
