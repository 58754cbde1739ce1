"""examples/real_engine.py against the real engine (llama-server with SmolLM2-135M), run as a
user runs it: a subprocess, with the backend given through AGENTBATCH_BACKEND."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support.workers import REPO

pytestmark = pytest.mark.engine


def test_real_engine_example(llama_server: Any) -> None:
    env = {**os.environ, "AGENTBATCH_BACKEND": llama_server.llamacpp_url,
           "AGENTBATCH_MODEL": llama_server.model}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "real_engine.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln[:1].isdigit()]
    assert len(lines) == 5 and all("label=" in ln for ln in lines), done.stdout
