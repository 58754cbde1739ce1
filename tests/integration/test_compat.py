"""The BatchAgent drop-in: the seeds' README snippets (BatchAgent 0.1/0.2, ../shared/seeds 000
and 001) run with only the import changed, over the real simulator (HTTP). The snippets name
vLLM, SGLang and Bedrock backends and their models: AGENTBATCH_COMPAT_BACKEND / _MODEL (the
facade's documented override) point them at the simulator. The seeds' ``task=...`` /
``inputs=...`` placeholders are filled with the quickstart's arguments."""

from __future__ import annotations

import textwrap

import pytest
from pydantic import BaseModel

from agentbatch import BatchSpecError, run_batch
from agentbatch.core.errors import UnknownParameter
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer

PAPERS = ["Paper A: a benchmark of KV caches.", "Paper B: prefix sharing.",
          "Paper C: speculative decoding."]


@pytest.fixture
def sim(monkeypatch):
    with SimServer(SimConfig(fixed_ms=5)) as server:
        monkeypatch.setenv("AGENTBATCH_COMPAT_BACKEND", "sim://" + server.url.split("://", 1)[1])
        monkeypatch.setenv("AGENTBATCH_COMPAT_MODEL", "agentbatch-sim")
        yield server


async def run_snippet(code: str, **names) -> dict:
    """Run ``code`` as the body of an async function (the seeds use top-level ``await``)."""
    scope = {**names}
    src = "async def __snippet__():\n" + textwrap.indent(textwrap.dedent(code), "    ") + \
          "\n    return locals()\n"
    exec(compile(src, "<seed snippet>", "exec"), scope)
    return await scope["__snippet__"]()


# The only change to each snippet: ``from batch_agent`` -> ``from agentbatch.compat``.
QUICKSTART_000 = '''
from agentbatch.compat import BatchAgent, Tool
from pydantic import BaseModel
class PaperSummary(BaseModel):
    benchmark_name: str | None
    primary_metric: str
    models_tested: list[str]
    summary: str
results = await BatchAgent.run(
    system_prompt="You are a precise scientific summarizer.",
    task="Extract benchmark info from this paper:\\n\\n{paper_text}",
    inputs=[{"paper_text": text} for text in papers],
    tools=[Tool.read_file, Tool.web_search],
    output_schema=PaperSummary,
    model="meta-llama/Llama-3.1-70B-Instruct",
    backend="vllm://localhost:8000",
    max_inflight=64,
    max_turns=4,
    max_retries=2,
    on_result=lambda r: print(r.output),
)
'''

STREAM_000 = '''
from agentbatch.compat import BatchAgent
async for result in BatchAgent.stream(task=TASK, inputs=INPUTS):
    if result.ok:
        process(result.output)  # Pydantic model, arrives as each agent finishes
    else:
        log_error(result.error)  # structured AgentError, not an exception
'''

BEDROCK_000 = '''
from agentbatch.compat import BatchAgent
results = await BatchAgent.run(
    task="Summarize: {text}",
    inputs=[{"text": t} for t in texts],
    model="anthropic.claude-sonnet-4-20250514-v1:0",
    backend="bedrock://us-east-1",
    max_inflight=2,  # start low; AIMD controller raises it automatically
)
'''

REDUCE_000 = '''
from agentbatch.compat import BatchAgent
results, summary = await BatchAgent.run_with_reduce(
    task="Extract claims from: {text}",
    inputs=[{"text": t} for t in texts],
    reduce="You received {n} claim lists. Deduplicate and rank by evidence.",
    output_schema=ClaimList,
    reduce_schema=RankedClaimList,
)
'''

QUICKSTART_001 = '''
from agentbatch.compat import BatchAgent, Tool
from pydantic import BaseModel
class PaperSummary(BaseModel):
    title: str
    contribution: str
    relevance: str
results = await BatchAgent.run(
    task="Summarize this paper and extract the key result:\\n\\n{paper}",
    inputs=[{"paper": text} for text in papers],
    tools=[Tool.web_search, Tool.read_file],
    output_schema=PaperSummary,
    model="Qwen/Qwen2.5-32B-Instruct",
    backend="sglang://localhost:30000",
    max_inflight=32,
    max_turns=3,
)
async for result in BatchAgent.stream(task=TASK, inputs=INPUTS):
    print(result.job_id, result.output)
'''

MAP_REDUCE_001 = '''
from agentbatch.compat import BatchAgent, Tool
results, paper = await BatchAgent.run_with_map_reduce(
    plan_prompt="Generate 20 research questions about: {topic}",
    plan_inputs={"topic": "KV cache optimization for multi-agent inference"},
    plan_output_schema=ResearchPlan,  # items: list[str]
    task="Research this question: {item}",
    output_schema=ResearchAnswer,
    reduce="Synthesize the answers into a survey.",
    reduce_schema=SurveyPaper,
    tools=[Tool.web_search],
    model="Qwen/Qwen2.5-32B-Instruct",
    backend="sglang://localhost:30000",
)
'''

RUNTIME_001 = '''
from agentbatch.compat import BatchAgent
results = await BatchAgent.run(
    runtime=OpenCodeRuntime(
        backend="sglang://localhost:30000",
        model="Qwen/Qwen2.5-32B-Instruct",
    ),
    task="Review this file for bugs: {file}",
    inputs=[{"file": f} for f in files],
    max_agents=20,
)
'''


class ClaimList(BaseModel):
    claims: list[str]


class RankedClaimList(BaseModel):
    ranked: list[str]


class ResearchPlan(BaseModel):
    items: list[str]


class ResearchAnswer(BaseModel):
    answer: str


class SurveyPaper(BaseModel):
    title: str
    body: str


async def test_quickstart_000_runs_unchanged(sim, capsys):
    out = await run_snippet(QUICKSTART_000, papers=PAPERS)
    results = out["results"]
    assert [r.ok for r in results] == [True] * 3
    assert type(results[0].output).__name__ == "PaperSummary"
    assert capsys.readouterr().out.count("summary=") == 3  # on_result saw each one
    assert sim.state.stats.as_dict()["requests"].get("chat_completions", 0) >= 3


async def test_stream_000_and_quickstart_001_with_job_ids(sim, capsys):
    seen, errors = [], []
    inputs = [{"paper": p} for p in PAPERS]
    task = "Summarize:\n\n{paper}"
    await run_snippet(STREAM_000, TASK=task, INPUTS=inputs, process=seen.append,
                      log_error=errors.append)
    assert len(seen) == 3 and errors == []
    out = await run_snippet(QUICKSTART_001, papers=PAPERS, TASK=task, INPUTS=inputs)
    assert all(r.ok for r in out["results"])
    printed = sorted(line.split(" ", 1)[0] for line in capsys.readouterr().out.splitlines())
    assert printed == ["0", "1", "2"]  # result.job_id, one per agent


async def test_bedrock_000_runs_on_the_mapped_backend(sim):
    out = await run_snippet(BEDROCK_000, texts=["one", "two"])
    assert [r.ok for r in out["results"]] == [True, True]


async def test_reduce_000_runs_unchanged(sim):
    out = await run_snippet(REDUCE_000, texts=["a", "b", "c"], ClaimList=ClaimList,
                            RankedClaimList=RankedClaimList)
    assert len(out["results"]) == 3 and all(r.ok for r in out["results"])
    assert isinstance(out["summary"], RankedClaimList)


async def test_map_reduce_001_runs_unchanged(sim):
    out = await run_snippet(MAP_REDUCE_001, ResearchPlan=ResearchPlan,
                            ResearchAnswer=ResearchAnswer, SurveyPaper=SurveyPaper)
    assert out["results"] and all("item" in r.input for r in out["results"])
    assert isinstance(out["paper"], SurveyPaper)


async def test_runtime_001_is_refused_naming_the_parameter(sim):
    with pytest.raises(BatchSpecError, match="runtime= has no equivalent"):
        await run_snippet(RUNTIME_001, OpenCodeRuntime=lambda **kw: object(), files=["a.py"])
    assert sim.state.stats.as_dict()["requests"] == {}


async def test_unsupported_and_renamed_parameters(sim):
    from agentbatch.compat import BatchAgent, Tool

    with pytest.raises(BatchSpecError, match="kvflow= has no equivalent"):
        await BatchAgent.run(task="t", inputs=[{}], kvflow=True)
    with pytest.raises(BatchSpecError, match="not both"):
        await BatchAgent.run(task="t", inputs=[{}], max_concurrent=2, max_inflight=3)
    with pytest.raises(UnknownParameter, match="max_turn"):
        await BatchAgent.run(task="t", inputs=[{}], max_turn=2)
    with pytest.raises(BatchSpecError, match="cost_budget= has no equivalent"):
        Tool.define(len, cost_budget=3)
    assert sim.state.stats.as_dict()["requests"] == {}
    results = await BatchAgent.run(task="Item {i}.\n@sim answer ok-{i}\nThanks.",
                                   inputs=[{"i": i} for i in range(4)], max_concurrent=2)
    assert [r.text for r in results] == [f"ok-{i}" for i in range(4)]


def test_define_builds_the_same_tool_as_the_decorator():
    from agentbatch import tool
    from agentbatch.compat import Tool

    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        return key

    defined = Tool.define(lookup, cacheable=True)
    decorated = tool(cacheable=True)(lookup)
    assert defined.openai_schema() == decorated.openai_schema()
    assert defined.cacheable and defined.import_path == decorated.import_path


@pytest.mark.parametrize("name, hint", [("max_concurrent", "max_inflight"),
                                        ("max_agents", "max_inflight"),
                                        ("max_turn", "max_turns")])
def test_unknown_keyword_hints_by_meaning(name, hint):
    # before: max_concurrent -> 'max_turns', max_agents -> 'max_tokens' (spelling only)
    with pytest.raises(UnknownParameter, match=f"did you mean '{hint}'"):
        run_batch("x", [{}], model="m", backend="sim://127.0.0.1:9", **{name: 3})
