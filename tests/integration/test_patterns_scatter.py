"""aurora-swarm's patterns over a pool of real simulator servers (HTTP): scatter_gather,
broadcast, generate_batch and tree_reduce, on the embedded engine and, where a batch is
involved, on the distributed one (real redis-server, real worker processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from agentbatch import BatchSpecError
from agentbatch.patterns.generate import agenerate_batch, generate_batch
from agentbatch.patterns.scatter import abroadcast, scatter_gather
from agentbatch.patterns.tree import Synthesis, tree_reduce
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer

MODEL = "agentbatch-sim"


class Word(BaseModel):
    word: str


@pytest.fixture
def sims() -> Iterator[list[SimServer]]:
    with SimServer(SimConfig(fixed_ms=5)) as a, SimServer(SimConfig(fixed_ms=5)) as b, \
            SimServer(SimConfig(fixed_ms=5)) as c:
        yield [a, b, c]


def url(sim: SimServer, scheme: str = "sim") -> str:
    return f"{scheme}://" + sim.url.split("://", 1)[1]


def requests(sim: SimServer) -> dict[str, int]:
    return dict(sim.state.stats.as_dict()["requests"])


def prompt(i: int) -> str:
    # the directive is not the last line: a rendered prompt closes the line with a marker
    return f"Item {i}.\n@sim answer item-{i}\nThanks."


# -- generate_batch ----------------------------------------------------------------------------


def test_generate_batch_sends_batched_completions_in_input_order(sims):
    pool = [url(s) for s in sims[:2]]
    results = generate_batch([prompt(i) for i in range(50)], backend=pool, model=MODEL)
    assert [r.text for r in results] == [f"item-{i}" for i in range(50)]
    assert [r.index for r in results] == list(range(50)) and all(r.ok for r in results)
    # all 50 are queued before the batching window closes: 32 + 18, one request per endpoint
    assert [requests(s) for s in sims[:2]] == [{"completions": 1}, {"completions": 1}]


def test_generate_batch_falls_back_to_concurrent_chat_calls(sims):
    # http:// is a generic OpenAI-compatible server: nothing says it takes a list of prompts
    results = generate_batch([prompt(i) for i in range(6)], backend=url(sims[0], "http"),
                             model=MODEL)
    assert [r.text for r in results] == [f"item-{i}" for i in range(6)]
    assert requests(sims[0]) == {"chat_completions": 6}


async def test_generate_batch_keeps_schema_and_server_failures_as_data(sims):
    prompts = ["Give a word.", "Item 1.\n@sim answer not json\nThanks.",
               "Item 2.\n@sim fail http_500 times=9\nThanks.", "Another word."]
    results = await agenerate_batch(prompts, backend=url(sims[0]), model=MODEL,
                                    output_schema=Word, batch_prompting=False)
    assert [r.ok for r in results] == [True, False, False, True]
    assert isinstance(results[0].output, Word) and isinstance(results[3].output, Word)
    assert results[1].error.kind == "invalid_output"
    assert results[2].error.kind == "server_error"  # after the retry layer's 4 attempts
    assert requests(sims[0]) == {"chat_completions": 3 + 4}


@pytest.mark.parametrize("bad, named", [
    ({"prompts": "one string"}, "prompts must be a list"),
    ({"backend": []}, "backend= is an empty pool"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"output_schema": dict}, "output_schema"),
])
def test_generate_batch_bad_input_is_refused_before_sending(sims, bad, named):
    kwargs = {"prompts": ["hi"], "backend": url(sims[0]), "model": MODEL, **bad}
    with pytest.raises(BatchSpecError, match=named):
        generate_batch(kwargs.pop("prompts"), **kwargs)
    assert requests(sims[0]) == {}


# -- scatter_gather / broadcast -------------------------------------------------------------


def test_scatter_gather_over_a_hostfile_pool_batches_and_keeps_order(sims, tmp_path):
    hostfile = tmp_path / "agents.hostfile"
    hostfile.write_text("# two endpoints\n" + "\n".join(url(s) for s in sims[:2]) + "\n")
    results = scatter_gather([prompt(i) for i in range(40)], backend=f"@{hostfile}",
                             model=MODEL)
    assert [r.text for r in results] == [f"item-{i}" for i in range(40)]
    assert [r.input for r in results] == [{"prompt": prompt(i)} for i in range(40)]
    seen = [requests(s) for s in sims[:2]]
    assert all(s.get("completions", 0) >= 1 for s in seen), seen  # both endpoints, batched


@pytest.mark.redis
@pytest.mark.slow
def test_scatter_gather_on_the_distributed_engine(sims, redis_url, start_workers):
    start_workers(1, concurrency=8)
    results = scatter_gather([prompt(i) for i in range(12)], backend=[url(s) for s in sims],
                             model=MODEL, redis_url=redis_url, output_schema=None)
    assert [r.text for r in results] == [f"item-{i}" for i in range(12)]
    assert sum(sum(requests(s).values()) for s in sims) >= 1


@pytest.mark.parametrize("pool", [[], "@EMPTY"])
def test_scatter_gather_over_an_empty_pool_is_refused_before_sending(
        sims, tmp_path, monkeypatch, pool):
    # a configured default backend must not stand in for an explicitly empty pool
    monkeypatch.setenv("AGENTBATCH_BACKEND", url(sims[0]))
    empty = tmp_path / "empty.hostfile"
    empty.write_text("# nobody here\n")
    backend = f"@{empty}" if pool == "@EMPTY" else pool
    with pytest.raises(BatchSpecError, match=r"empty pool|lists no endpoints"):
        scatter_gather([prompt(0)], backend=backend, model=MODEL)
    assert requests(sims[0]) == {}


def test_scatter_gather_refuses_tools():
    with pytest.raises(BatchSpecError, match="tools= does not apply"):
        scatter_gather(["x"], backend="sim://127.0.0.1:9", model=MODEL, tools=["a:b"])


async def test_broadcast_sends_one_prompt_to_every_endpoint(sims):
    pool = [url(s) for s in sims]
    results = await abroadcast("Item 0.\n@sim answer pong\nThanks.", backend=pool, model=MODEL)
    assert [r.text for r in results] == ["pong"] * 3
    assert [r.input["endpoint"] for r in results] == pool
    assert [r.index for r in results] == [0, 1, 2]
    assert [requests(s).get("chat_completions") for s in sims] == [1, 1, 1]


# -- tree_reduce ------------------------------------------------------------------------------


def test_tree_reduce_leaves_then_supervisors(sims):
    leaves, reduced = tree_reduce([f"Fact {i}." for i in range(7)], fan_in=3,
                                  backend=url(sims[0]), model=MODEL, warm_prefix=False)
    assert [r.input for r in leaves] == [{"item": f"Fact {i}."} for i in range(7)]
    assert all(r.ok for r in leaves)
    assert isinstance(reduced, Synthesis)
    # 7 leaves, then ceil(7/3)=3 supervisors, then one root: 11 model calls
    assert requests(sims[0]).get("chat_completions") == 11


@pytest.mark.parametrize("bad, named", [
    ({"fan_in": 1}, "fan_in must be an int >= 2"),
    ({"items": []}, "items is empty"),
    ({"reduce": "Combine {answers}"}, "names {answers}"),
])
def test_tree_reduce_bad_input_is_refused_before_sending(sims, bad, named):
    kwargs = {"items": ["a", "b"], "backend": url(sims[0]), "model": MODEL, **bad}
    with pytest.raises(BatchSpecError, match=named):
        tree_reduce(kwargs.pop("items"), **kwargs)
    assert requests(sims[0]) == {}
