"""A sync tool that outlives its timeout must not hold ``run_batch`` or interpreter exit.

Each case runs a whole program in a subprocess (simulator included), because what is under
test is whether that process can return and exit while the tool's thread is still stuck.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent('''
    import json, threading, time
    from agentbatch import run_batch, tool
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.server import SimServer

    @tool(timeout=0.5)
    def stuck(key: str) -> str:
        """A tool that does not come back in time.

        Args:
            key: anything.
        """
        {body}
        return "late"

    with SimServer(SimConfig(fixed_ms=5)) as sim:
        backend = "sim://" + sim.url.split("://", 1)[1]
        results = run_batch('Agent {{i}}.\\n@sim tool stuck {{{{"key": "k{{i}}"}}}}',
                            [{{"i": i}} for i in range(3)], model="m", backend=backend,
                            tools=[stuck], max_turns=3)
    print("RESULTS " + json.dumps([
        {{"ok": r.ok, "calls": [c.ok for c in r.tool_calls], "text": r.text}}
        for r in results
    ]), flush=True)
''')

# Generous: the stuck tool sleeps 30 s (or forever); a run that waits for it cannot pass.
_EXIT_BOUND_S = 20


@pytest.mark.parametrize("body", ["time.sleep(30)", "threading.Event().wait()"],
                         ids=["sleeps_30s", "never_returns"])
def test_timed_out_sync_tool_frees_run_batch_and_exit(tmp_path: Path, body: str) -> None:
    script = tmp_path / "stuck_tool.py"
    script.write_text(_SCRIPT.format(body=body))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=_EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the program did not exit within {_EXIT_BOUND_S}s; stdout: {out!r}")
    assert proc.returncode == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert len(results) == 3
    # Every agent saw its tool call fail (the timeout) and the batch went on to finish.
    assert all(r["calls"] and r["calls"][0] is False for r in results), results
