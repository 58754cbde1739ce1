"""Cost-aware execution: the provider's batch API (half price, slow) within a deadline.

``pricing="auto"`` sends a turn through the batch API while its agent still finishes by
``deadline=``, and through the normal API when it would not. With ``prices=`` every result
carries its ``cost_usd``, and ``handle.progress()`` the batch's spend.

    python examples/cost_auto.py     # a simulator whose provider batches answer in ~1 s
    AGENTBATCH_BACKEND=openai://api.openai.com AGENTBATCH_MODEL=gpt-4o-mini \\
        python examples/cost_auto.py # OpenAI's Batch API: minutes to hours, so a long deadline
    python examples/cost_auto.py --distributed  # the same on the distributed engine

``--distributed`` runs the batch on ``AGENTBATCH_REDIS_URL``'s workers, or on a throwaway
redis-server and one ``agentbatch worker`` started here (see ``_fleet.py``). The caps and the
spend are then fleet-wide, and each worker routes the turns it runs (docs/cost.md, "On the
distributed engine"). With ``AGENTBATCH_REDIS_URL`` exported, agentbatch picks the
distributed engine even without the flag.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

from _backend import MODEL, backend_url, on_simulator
from _fleet import redis_and_worker

from agentbatch import BatchHandle, submit_batch

# US dollars per million tokens; the batch_ prices are what the batch API charges
PRICES = {MODEL: {"prompt": 0.15, "completion": 0.60,
                  "batch_prompt": 0.075, "batch_completion": 0.30}}
DOCS = ["the quarterly report", "the incident review", "the design memo", "the user survey",
        "the release notes", "the hiring plan"]


def served(handle: BatchHandle) -> tuple[int, int]:
    """(turns the batch API answered, turns the sync API answered), from the handle's
    counters: the embedded engine's ``stats()["provider_batch"]``, the distributed engine's
    ``stat:`` fields in ``status()`` (the fleet's, kept in Redis)."""
    if handle.runs_on.startswith("distributed"):
        stat = {k[5:]: n for k, n in handle.status().items() if k.startswith("stat:")}
        routed_sync = sum(n for k, n in stat.items() if k.startswith("routed_sync_"))
        # items sent to the batch API whose answer the turn did not take: a hedge the sync
        # API won, an item that failed or expired (answered by the sync API), a re-submit
        lost = stat.get("hedge_won_by_sync", 0) + stat.get("provider_batch_fallback_sync", 0)
        by_batch = (stat.get("provider_batch_items", 0) - lost
                    - stat.get("provider_batch_resubmitted", 0))
        return by_batch, routed_sync + lost
    routes = handle.stats()["provider_batch"]  # the embedded handle's
    routed_sync = sum(n for k, n in routes.items() if k.startswith("routed_sync_"))
    return routes.get("served_batch", 0), routes.get("served_sync", 0) + routed_sync


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--distributed", action="store_true",
                        help="run on the distributed engine (AGENTBATCH_REDIS_URL's workers, "
                             "or a redis-server and one worker started here)")
    args = parser.parse_args()
    # a real provider's batch takes minutes to hours: give it six; the simulator one minute
    deadline = 60 if on_simulator() else 6 * 3600  # seconds from submit, or an aware datetime
    with ExitStack() as stack:
        backend = stack.enter_context(backend_url(batch_latency_s=1.0))
        # the workers get the backend URL from the batch's plan: this simulator, on 127.0.0.1
        redis_url = stack.enter_context(redis_and_worker()) if args.distributed else None
        handle = submit_batch("Summarise {doc} in one sentence.", [{"doc": d} for d in DOCS],
                              model=MODEL, backend=backend, prices=PRICES, pricing="auto",
                              deadline=deadline, max_cost_usd=1.0, redis_url=redis_url)
        with handle:
            results = handle.wait()
            spent = handle.progress().cost_usd or 0.0
            by_batch, by_sync = served(handle)  # which API served the turns
    for r in results:
        print(r.index, r.input["doc"], f"${r.cost_usd:.7f}" if r.ok else r.error)
    price = PRICES[MODEL]
    list_price = sum(r.usage.prompt_tokens * price["prompt"]
                     + r.usage.completion_tokens * price["completion"] for r in results) / 1e6
    turns = sum(r.turns for r in results)
    print(f"{sum(r.ok for r in results)}/{len(results)} ok, spent ${spent:.7f} "
          f"(${list_price:.7f} at sync prices): {by_batch} of {turns} turns by the batch API, "
          f"{by_sync} by the sync API, on the {handle.runs_on.split(' (')[0]} engine")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
