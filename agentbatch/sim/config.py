"""Simulator settings, shared by the in-process server, the subprocess wrapper and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from agentbatch.sim.faults import parse_fault_rates
from agentbatch.sim.tokens import MAX_MODEL_LEN

DEFAULT_MODEL = "agentbatch-sim"

__all__ = ["DEFAULT_MODEL", "SimConfig", "config_to_argv", "parse_fault_rates"]


@dataclass
class SimConfig:
    """Everything the simulator can be told; construct with keyword arguments."""

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 0
    """TCP port; 0 picks a free one (SimServer reports it in ``.url``)."""
    models: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    """Names listed by ``GET /v1/models``; the first labels ``/metrics``."""
    accept_any_model: bool = True
    """Answer requests for any model name (else 404 for names not in ``models``)."""
    fixed_ms: float | None = None
    """If set: every request costs this many ms, unlimited concurrency (no GPU-like queue)."""
    max_running: int = 64
    """GPU-like mode: sequences decoded together; the rest wait in a FIFO queue."""
    prefill_ms_per_token: float = 0.05
    """GPU-like mode: prefill cost per uncached prompt token."""
    decode_ms: float = 8.0
    """GPU-like mode: cost of one decode step for a batch of one."""
    decode_batch_slope: float = 0.01
    """GPU-like mode: step cost is ``decode_ms * (1 + slope * running)``: big batches are slower."""
    tokens_per_step: int = 4
    """GPU-like mode: tokens decoded per engine step (fewer, longer steps keep the loop cheap)."""
    max_waiting: int | None = None
    """GPU-like mode: reject with 429 when the waiting queue is this long (None: unbounded)."""
    queue_full_retry_after_s: float = 1.0
    """Retry-After sent with a queue-full 429."""
    cache_blocks: int = 100_000
    """Prefix-cache capacity in 16-token blocks (LRU)."""
    fault_rates: dict[str, float] = field(default_factory=dict)
    """Random chaos: fault kind -> probability per request (see ``parse_fault_rates``)."""
    seed: int = 0
    """Seed for random faults; with the same request order the same requests fail."""
    timeout_hold_s: float = 30.0
    """How long a ``timeout`` fault holds the request before answering normally."""
    batch_latency_s: float = 2.0
    """Provider batch APIs (``batch_api.py``): median seconds from creation to a request done."""
    batch_latency_spread: float = 0.5
    """Sigma of the log-normal around that median (0: every request takes exactly the median)."""
    batch_expire_s: float = 86_400.0
    """A provider batch still open this long after creation expires (its completion window)."""
    batch_failure_rate: float = 0.0
    """Probability that one request of a provider batch fails (seeded per batch and request)."""
    max_model_len: int = MAX_MODEL_LEN
    """The context length in ``/tokenize`` tokens (code points of the sim's template), stated
    on ``/v1/models``; a chat request whose prompt plus ``max_tokens`` exceeds it gets vLLM's
    HTTP 400."""

    def __post_init__(self) -> None:
        if isinstance(self.fault_rates, str):
            self.fault_rates = parse_fault_rates(self.fault_rates)
        if isinstance(self.models, str):
            self.models = [self.models]
        if not self.models:
            self.models = [DEFAULT_MODEL]
        if self.batch_latency_s < 0 or self.batch_latency_spread < 0 or self.batch_expire_s <= 0:
            raise ValueError("batch_latency_s and batch_latency_spread must be >= 0, "
                             "batch_expire_s > 0")
        if not 0 <= self.batch_failure_rate <= 1:
            raise ValueError("batch_failure_rate must be in [0, 1]")
        if min(self.max_running, self.tokens_per_step, self.cache_blocks, self.max_model_len) < 1:
            raise ValueError("max_running, tokens_per_step, cache_blocks and max_model_len "
                             "must be >= 1")

    @property
    def gpu_like(self) -> bool:
        return self.fixed_ms is None


def config_to_argv(config: SimConfig) -> list[str]:
    """Command-line flags for ``python -m agentbatch.sim`` that reproduce ``config``."""
    argv: list[str] = []
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None or f.name == "accept_any_model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "models":
            for name in value:
                argv += ["--model", name]
        elif f.name == "fault_rates":
            if value:
                argv += ["--fault-rate", ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            argv += [flag, str(value)]
    if not config.accept_any_model:
        argv.append("--strict-models")
    return argv
