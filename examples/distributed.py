"""The distributed engine: agent state in Redis, turns run by ``agentbatch worker`` processes.

    AGENTBATCH_REDIS_URL=redis://host:6379/0 python examples/distributed.py

with workers already running (``agentbatch worker --redis-url ...`` on any machine). Unset,
this example starts a throwaway ``redis-server`` and one worker itself (the redis-server binary
must be installed). The submitter may leave: ``get_batch(batch_id)`` re-attaches from anywhere.
"""

from __future__ import annotations

from _backend import MODEL, backend_url, sim_hint
from _fleet import redis_and_worker

from agentbatch import get_batch, submit_batch

DEADLINE_S = 60.0


def main() -> int:
    task = "Write one line about city #{n}." + sim_hint("answer city-{n} is lovely") + "\n"
    with backend_url() as backend, redis_and_worker() as redis_url:
        handle = submit_batch(task, [{"n": i} for i in range(20)], model=MODEL,
                              backend=backend, redis_url=redis_url, max_turns=2)
        print("submitted", handle.batch_id)
        # Any process can re-attach to the batch by id and read its results.
        again = get_batch(handle.batch_id, redis_url=redis_url)
        results = again.wait(timeout=DEADLINE_S)
        print(again.status())
    for r in results[:5]:
        print(r.index, r.text if r.ok else r.error)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
