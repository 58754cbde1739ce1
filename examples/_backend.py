"""Where the examples send their requests.

``AGENTBATCH_BACKEND`` (a URL, comma-separated URLs, or ``@hostfile``) and ``AGENTBATCH_MODEL``
point them at your server. Unset, each example starts the built-in simulator in the background
(as ``agentbatch demo`` does), so it runs on a laptop with no GPU. ``@sim ...`` lines script
the simulator's replies; ``sim_hint`` drops them when a real model is answering.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

BACKEND_ENV = "AGENTBATCH_BACKEND"
MODEL = os.environ.get("AGENTBATCH_MODEL", "agentbatch-sim")


def on_simulator() -> bool:
    return not os.environ.get(BACKEND_ENV)


def sim_hint(line: str) -> str:
    """``"\\n@sim <line>"`` on the simulator; empty for a real model."""
    return f"\n@sim {line}" if on_simulator() else ""


@contextmanager
def backend_pool(simulators: int = 1, **sim: float) -> Iterator[list[str]]:
    """The endpoint URLs to use: yours, or ``simulators`` simulator processes started here
    (``sim``: more of their ``SimConfig``, e.g. ``batch_latency_s``)."""
    given = os.environ.get(BACKEND_ENV)
    if given:
        yield [u.strip() for u in given.split(",") if u.strip()]
        return
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.process import SimProcess

    with ExitStack() as stack:
        sims = [stack.enter_context(SimProcess(SimConfig(fixed_ms=20, **sim)))
                for _ in range(simulators)]
        yield ["sim://" + s.url.split("://", 1)[1] for s in sims]


@contextmanager
def backend_url(**sim: float) -> Iterator[str]:
    """One endpoint URL (the first of ``backend_pool``)."""
    with backend_pool(1, **sim) as urls:
        yield urls[0]
