"""aurora-swarm's patterns over a pool of endpoints: scatter_gather, broadcast, generate_batch.

The pool is a list of URLs or ``"@hostfile"`` (one URL or host:port per line). Where the
servers take a list of prompts (vLLM, SGLang, llama.cpp), prompts travel batched in
``/v1/completions`` requests; elsewhere each is its own chat call.
"""

from __future__ import annotations

from _backend import MODEL, backend_pool, sim_hint

from agentbatch import broadcast, generate_batch, scatter_gather


def main() -> int:
    with backend_pool(simulators=2) as pool:
        prompts = [f"Name one gene related to trait {i}." + sim_hint(f"answer GENE{i}") + "\n"
                   for i in range(20)]
        gathered = scatter_gather(prompts, backend=pool, model=MODEL, max_tokens=32)
        print("scatter_gather:", [r.text for r in gathered[:5]], "...")
        everyone = broadcast("Say hello." + sim_hint("answer hello") + "\n", backend=pool,
                             model=MODEL, max_tokens=16)
        print("broadcast:", [(r.input["endpoint"], r.text) for r in everyone])
        raw = generate_batch(prompts[:8], backend=pool, model=MODEL, max_tokens=32)
        print("generate_batch:", [r.text for r in raw])
    results = [*gathered, *everyone, *raw]
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
