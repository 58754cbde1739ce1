"""The mutable state of one simulator instance, owned by its event loop."""

from __future__ import annotations

from agentbatch.sim.config import SimConfig
from agentbatch.sim.engine import make_engine
from agentbatch.sim.faults import Fault, FaultState, RandomFaults
from agentbatch.sim.metrics import SimStats, render_prometheus
from agentbatch.sim.script import FailSpec
from agentbatch.sim.tokens import PrefixCache


class SimState:
    """Counters, prefix cache, fault bookkeeping and the scheduler; reset by ``/sim/reset``."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stats = SimStats()
        self.cache = PrefixCache(config.cache_blocks)
        self.faults = FaultState()
        self.random_faults = RandomFaults(config.fault_rates, config.seed)
        self.engine = make_engine(config, self.stats, self.cache)
        self.request_counter = 0

    def next_request(self, endpoint: str) -> int:
        """Count a request and return its number (the seed for its random-fault draw)."""
        self.request_counter += 1
        self.stats.requests[endpoint] += 1
        return self.request_counter

    def decide_fault(
        self, agent_key: str, fails: list[FailSpec], n: int, sub: int = 0
    ) -> Fault | None:
        """Scripted faults first (they are what a test asked for), then seeded chaos."""
        fault = self.faults.next_fault(agent_key, fails) or self.random_faults.decide(n, sub)
        if fault is not None:
            self.stats.faults[fault.kind] += 1
        return fault

    def model_ok(self, name: str | None) -> bool:
        return self.config.accept_any_model or name in self.config.models

    def metrics_text(self) -> str:
        return render_prometheus(self.stats, self.config.models[0], self.engine.cache_usage())

    def reset(self) -> None:
        self.stats.reset()
        self.cache.clear()
        self.faults.clear()
        self.request_counter = 0
