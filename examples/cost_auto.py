"""Cost-aware execution: the provider's batch API (half price, slow) within a deadline.

``pricing="auto"`` sends a turn through the batch API while its agent still finishes by
``deadline=``, and through the normal API when it would not. With ``prices=`` every result
carries its ``cost_usd``, and ``handle.progress()`` the batch's spend.

    python examples/cost_auto.py     # a simulator whose provider batches answer in ~1 s
    AGENTBATCH_BACKEND=openai://api.openai.com AGENTBATCH_MODEL=gpt-4o-mini \\
        python examples/cost_auto.py # OpenAI's Batch API: minutes to hours, so a long deadline
"""

from __future__ import annotations

from _backend import MODEL, backend_url, on_simulator

from agentbatch import submit_batch

# US dollars per million tokens; the batch_ prices are what the batch API charges
PRICES = {MODEL: {"prompt": 0.15, "completion": 0.60,
                  "batch_prompt": 0.075, "batch_completion": 0.30}}
DOCS = ["the quarterly report", "the incident review", "the design memo", "the user survey",
        "the release notes", "the hiring plan"]


def main() -> int:
    # a real provider's batch takes minutes to hours: give it six; the simulator one minute
    deadline = 60 if on_simulator() else 6 * 3600  # seconds from submit, or an aware datetime
    with backend_url(batch_latency_s=1.0) as backend:
        handle = submit_batch("Summarise {doc} in one sentence.", [{"doc": d} for d in DOCS],
                              model=MODEL, backend=backend, prices=PRICES, pricing="auto",
                              deadline=deadline, max_cost_usd=1.0)
        with handle:
            results = handle.wait()
            spent = handle.progress().cost_usd or 0.0
            routes = handle.stats()["provider_batch"]  # which API served the turns
    for r in results:
        print(r.index, r.input["doc"], f"${r.cost_usd:.7f}" if r.ok else r.error)
    sync = routes.get("served_sync", 0) + sum(n for k, n in routes.items()
                                              if k.startswith("routed_sync_"))
    price = PRICES[MODEL]
    list_price = sum(r.usage.prompt_tokens * price["prompt"]
                     + r.usage.completion_tokens * price["completion"] for r in results) / 1e6
    print(f"{sum(r.ok for r in results)}/{len(results)} ok, spent ${spent:.7f} "
          f"(${list_price:.7f} at sync prices): {routes.get('served_batch', 0)} turns by the "
          f"batch API, {sync} by the sync API")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
