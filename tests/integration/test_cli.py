"""The `agentbatch` command, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from agentbatch.sim.process import free_port
from tests.support.workers import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _cli(*args: str, cwd=REPO, env=None, timeout=180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], cwd=cwd,
                          env=env or ENV, capture_output=True, text=True, timeout=timeout)


def test_run_spec_writes_results_jsonl(tmp_path, sim_url):
    (tmp_path / "docs").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "docs" / f"{name}.txt").write_text(f"contents of {name}")
    (tmp_path / "inputs.jsonl").write_text(
        "\n".join(json.dumps({"name": n}) for n in ("a", "b", "c")) + "\n")
    (tmp_path / "spec.yaml").write_text(f"""
task: |
  Summarise {{name}}.
  @sim tool read_file {{{{"path": "{{name}}.txt"}}}}
inputs: inputs.jsonl
tools: ["agentbatch.toolpool.builtins:read_file"]
output_schema: "tests.support.tools:Answer"
model: sim-model
backend: "{sim_url}"
max_turns: 3
""")
    env = {**ENV, "AGENTBATCH_FILE_ROOT": str(tmp_path / "docs")}
    out = tmp_path / "out.jsonl"
    proc = _cli("run", str(tmp_path / "spec.yaml"), "-o", str(out), env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1, 2]
    assert all(r["ok"] and set(r["output"]) == {"summary", "score"} for r in rows)
    assert all(r["tool_calls"][0]["ok"] for r in rows)
    assert "3 ok, 0 failed" in proc.stdout


def test_run_spec_with_bad_input_names_the_index(tmp_path, sim_url):
    (tmp_path / "spec.yaml").write_text(f"""
task: "Hello {{who}}"
inputs: [{{"who": "x"}}, {{"whom": "y"}}]
model: m
backend: "{sim_url}"
""")
    proc = _cli("run", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "o.jsonl"))
    assert proc.returncode != 0
    assert "input 1" in (proc.stderr + proc.stdout)


def test_demo_runs_a_batch_against_its_own_simulator():
    proc = _cli("demo", "--agents", "20", "--fixed-ms", "5")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "20 / 20" in proc.stdout


def test_sim_command_serves_until_stopped():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentbatch.cli", "sim", "--port", str(port),
                             "--fixed-ms", "5"], env=ENV, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)
