"""Bad input to the `agentbatch` command: one clear line, exit status 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.workers import REPO

# A wide terminal, so rich does not wrap the words the tests look for.
ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}
ENV.pop("AGENTBATCH_REDIS_URL", None)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    for word in words:
        assert word in out, out


GOOD = 'task: "Say {x}"\nmodel: m\nbackend: "sim://127.0.0.1:9"\n'

# (id, spec text, inputs.jsonl text or None, words the one error line must contain)
SPECS = [
    ("missing task", "inputs: [{x: 1}]\nmodel: m\n", None, ["spec.yaml", "task", "required"]),
    ("unknown key", GOOD + "inputs: [{x: 1}]\nmax_turn: 3\n", None,
     ["unknown key 'max_turn'", "did you mean 'max_turns'"]),
    ("yaml list", "- task: t\n  inputs: []\n", None, ["spec.yaml", "mapping", "list"]),
    ("yaml syntax", "task: [unclosed\n", None, ["spec.yaml", "not valid YAML"]),
    ("bad jsonl line", GOOD + "inputs: in.jsonl\n", '{"x": 1}\n\n{"x": 2\n',
     ["in.jsonl line 3", "not valid JSON"]),
    ("jsonl line not an object", GOOD + "inputs: in.jsonl\n", '{"x": 1}\n[1, 2]\n',
     ["in.jsonl line 2", "JSON object"]),
    ("inputs file missing", GOOD + "inputs: nowhere.jsonl\n", None,
     ["nowhere.jsonl", "not found"]),
    ("bad submit value", GOOD + "inputs: [{x: 1}]\ntemperature: hot\n", None,
     ["temperature", "'hot'"]),
    ("bad input names its index", GOOD + "inputs: [{x: 1}, {y: 2}]\n", None,
     ["input 1", "'x'"]),
]


@pytest.mark.parametrize(("spec", "jsonl", "words"), [s[1:] for s in SPECS],
                         ids=[s[0] for s in SPECS])
def test_run_refuses_a_bad_spec_in_one_line(tmp_path, spec, jsonl, words):
    (tmp_path / "spec.yaml").write_text(spec)
    if jsonl is not None:
        (tmp_path / "in.jsonl").write_text(jsonl)
    proc = _cli("run", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "out.jsonl"))
    _refused(proc, *words)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_run_help_shows_an_example_spec():
    proc = _cli("run", "--help")
    assert proc.returncode == 0, proc.stderr
    for key in ("task:", "inputs:", "model:", "backend:", "tools:", "output_schema:"):
        assert key in proc.stdout, proc.stdout


@pytest.mark.redis
def test_status_of_an_unknown_batch_is_one_line(redis_url):
    proc = _cli("status", "no-such-batch", "--redis-url", redis_url)
    _refused(proc, "no batch 'no-such-batch'")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--queues", "infrence"], ["--queues", "unknown queue 'infrence'", "'inference'"]),
        (["--queues", "inference,tool"], ["unknown queue 'tool'", "'tools'"]),
        (["--redis-url", "garbage"], ["--redis-url", "not a Redis URL"]),
    ],
)
def test_worker_refuses_bad_arguments_before_starting(args, words):
    base = {"--queues": "inference,tools", "--redis-url": "redis://127.0.0.1:9/0"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    # A worker that started anyway would retry the broker until the timeout fails the test.
    proc = _cli("worker", *[x for kv in base.items() for x in kv], timeout=60)
    _refused(proc, *words)


def test_worker_masks_a_password_that_is_not_percent_encoded():
    proc = _cli("worker", "--redis-url", "redis://:s3cr#et@127.0.0.1:9/0", timeout=60)
    _refused(proc, "--redis-url", "percent-encoded")
    assert "s3cr" not in proc.stderr + proc.stdout


def test_worker_refuses_a_redis_url_twice_or_an_empty_url_file(tmp_path):
    url_file = tmp_path / "url"
    url_file.write_text("redis://127.0.0.1:9/0\n")
    proc = _cli("worker", "--redis-url", "redis://127.0.0.1:9/0", "--redis-url-file",
                str(url_file), timeout=60)
    _refused(proc, "--redis-url-file", "not both")
    url_file.write_text("\n")
    proc = _cli("worker", "--redis-url-file", str(url_file), timeout=60)
    _refused(proc, "--redis-url-file", "one Redis URL")
