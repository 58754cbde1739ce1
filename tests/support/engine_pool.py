"""Two real llama-servers for the pool fault tests (embedded and distributed), and the batch
id that homes their agents on both: the setup ``test_engine_pool.py`` and
``test_engine_pool_distributed.py`` share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from agentbatch.backends.pool import EndpointPool
from agentbatch.backends.registry import backend_from_url
from agentbatch.engine import EnginePaths, LlamaServer
from agentbatch.engine.server import free_port


@contextmanager
def server_pair(engine_paths: EnginePaths) -> Iterator[list[LlamaServer]]:
    """Two started servers (2 slots, ``-t 1`` each) on free ports; stopped on exit."""
    pair = [LlamaServer(engine_paths, port=free_port(), parallel=2, threads=1)
            for _ in range(2)]
    try:
        for s in pair:
            s.start()
        yield pair
    finally:
        for s in pair:
            s.stop()


def pick_batch(urls: list[str], b_url: str, agents: int, prefix: str
               ) -> tuple[str, list[int], list[int]]:
    """A batch id whose agents (keys ``{batch_id}:{index}``, as every engine keys them) would
    start at least two on B and one elsewhere on an idle pool, where load ties go by the
    rendezvous ranking (which depends on the servers' random ports, so the test chooses the
    id). Under load, first turns spread by load instead: B gets its share either way."""
    pool = EndpointPool([backend_from_url(u) for u in urls])
    b_port = b_url.rsplit(":", 1)[1]
    for k in range(1000):
        batch_id = f"{prefix}{k}"
        homes = [pool.endpoint_for(f"{batch_id}:{i}") or "" for i in range(agents)]
        on_b = [i for i, h in enumerate(homes) if h.endswith(f":{b_port}")]
        on_a = [i for i in range(agents) if i not in on_b]
        if len(on_b) >= 2 and on_a:
            return batch_id, on_a, on_b
    raise AssertionError("no batch id homes agents on both servers")
