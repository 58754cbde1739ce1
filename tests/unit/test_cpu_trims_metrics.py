"""The metric children looked up once (issue 26 item 5) record what ``.labels(...)`` on every
call recorded, and each series still appears when it did: in a fresh process, every step of
a run of model calls, replies and tool counters leaves the exposition byte for byte as the
code it replaces leaves a second, fresh registry."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import asyncio
    import json
    import types

    from prometheus_client import generate_latest

    import agentbatch.metrics as M
    from agentbatch.core.model_io import ModelResponse, Usage

    M.time = types.SimpleNamespace(monotonic=lambda: 5.0)  # every call lasts 0 s, both sides
    new = M.metrics()
    ref = M._declare()  # the same declarations, a registry of its own

    # --- the code replaced, on ``ref``: .labels(...) at every call ---
    class RefCall:
        def __init__(self, backend):
            self.backend = backend
        def __enter__(self):
            self.inflight = ref.model_inflight.labels(self.backend)
            self.inflight.inc()
        def __exit__(self, t, exc, tb):
            try:
                if isinstance(exc, Exception):
                    ref.turns.labels("failed", str(getattr(exc, "kind", "internal"))).inc()
            finally:
                self.inflight.dec()
                ref.model_latency.labels(self.backend).observe(0.0)

    def ref_reply(backend, response):
        ref.turns.labels("replied", "").inc()
        u = response.usage
        for kind, n in (("prompt", u.prompt_tokens), ("cached", u.cached_tokens),
                        ("completion", u.completion_tokens)):
            tokens = ref.tokens.labels(kind)
            if n > 0:
                tokens.inc(n)
        if response.ttft_s is not None:
            ref.model_ttft.labels(backend).observe(response.ttft_s)

    made = set()
    def ref_tool(tool, counter, n=1):
        if counter == "calls" and tool not in made:
            for other, labels in M._TOOL_COUNTERS.values():
                getattr(ref, other).labels(tool, *labels.values())
            made.add(tool)
        name, extra = M._TOOL_COUNTERS.get(counter, (None, {}))
        if name is not None:
            getattr(ref, name).labels(tool, *extra.values()).inc(n)

    def text(registry):
        return [line for line in generate_latest(registry).decode().splitlines()
                if "_created" not in line]

    out = []
    def check(step):
        out.append([step, text(new.registry) == text(ref.registry),
                    text(new.registry), text(ref.registry)])

    class Failed(Exception):
        kind = "timeout"

    def reply(prompt, cached, completion, ttft=None):
        return ModelResponse(usage=Usage(prompt_tokens=prompt, cached_tokens=cached,
                                         completion_tokens=completion), ttft_s=ttft)

    check("nothing yet")
    a, b = M.model_call("b1"), RefCall("b1")
    a.__enter__(); b.__enter__()
    check("b1 in flight: no latency series yet")
    a.__exit__(None, None, None); b.__exit__(None, None, None)
    check("b1 returned")
    for cm in (M.model_call("b1"), RefCall("b1")):
        try:
            with cm:
                raise Failed("x")
        except Failed:
            pass
    check("b1 failed: no reply or token series")
    for cm in (M.model_call("b2"), RefCall("b2")):
        try:
            with cm:
                raise asyncio.CancelledError()
        except asyncio.CancelledError:
            pass
    check("b2 cancelled: not a failure")
    for args in [(10, 0, 5), (7, 3, 0, 0.25), (0, 0, 0), (1, 0, 2, 0.002)]:
        for backend in ("b1", "b2", "b3"):
            M.record_reply(backend, reply(*args)); ref_reply(backend, reply(*args))
            check(f"{backend} replied {args}")
    for tool, counter, n in [("t1", "executions", 1), ("t1", "calls", 1),
                             ("t1", "cache_hits", 1), ("t1", "coalesced", 2),
                             ("t1", "calls", 1), ("t2", "calls", 1), ("t2", "errors", 3),
                             ("t2", "timeouts", 1), ("t2", "nonsense", 1),
                             ("t3", "nonsense", 1), ("t3", "calls", 1)]:
        M.record_tool(tool, counter, n); ref_tool(tool, counter, n)
        check(f"{tool} {counter} {n}")
    same = M._backend("b1").inflight() is new.model_inflight.labels("b1")
    print(json.dumps({"steps": out, "same_child": same}))
''')


def test_every_step_exposes_what_the_labels_lookups_exposed() -> None:
    import json

    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["same_child"]
    steps = result["steps"]
    assert len(steps) == 1 + 4 + 12 + 11
    for step, same, got, want in steps:
        assert same, (step, sorted(set(got) ^ set(want)))
    # the run did record something on every kind of series (the check compares real text)
    last = "\n".join(steps[-1][2])
    for needle in ('agentbatch_model_ttft_seconds_count{backend="b1"} 2.0',
                   'agentbatch_model_inflight{backend="b1"} 0.0',
                   'agentbatch_turns_total{error_kind="timeout",outcome="failed"} 1.0',
                   'agentbatch_tokens_total{kind="cached"} 9.0',
                   'agentbatch_tool_shared_total{how="coalesced",tool="t1"} 2.0',
                   'agentbatch_tool_timeouts_total{tool="t3"} 0.0'):
        assert needle in last, needle
    first_flight = "\n".join(steps[1][2])
    assert "agentbatch_model_inflight{backend=\"b1\"} 1.0" in first_flight
    assert "agentbatch_model_latency_seconds_count" not in first_flight
    assert "agentbatch_model_ttft_seconds_count" not in "\n".join(steps[6][2])
