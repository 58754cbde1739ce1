"""Fixtures for tests against the real engine: llama.cpp's ``llama-server`` with SmolLM2-135M.

When engine tests are selected and the engine is not in the per-machine cache, it is installed
once after collection (outside any test, so the per-test timeout does not cut the ~10 minute
first build short; ``agentbatch engine install`` does the same by hand). If it cannot be
installed, engine tests skip with the reason, except under ``CI_REQUIRE_ENGINE=1`` (set by
``.ci/run``), where they fail: CI never passes by skipping them. ``llama_server`` is one server
for the whole session; a test that kills its server starts its own ``LlamaServer(engine_paths)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from agentbatch.engine import (
    INSTALL_COMMAND,
    EngineError,
    EnginePaths,
    LlamaServer,
    install,
    installed,
)

REQUIRE_ENV = "CI_REQUIRE_ENGINE"
_install_errors: list[str] = []


ENGINE_TEST_TIMEOUT_S = 900  # the longest wait an engine test gives the engine, plus room


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """An engine test waits up to 600-900 s for a small CPU model on a loaded 2-core machine:
    its own deadlines, not the suite's 300 s default, bound it (an explicit mark wins)."""
    for item in items:
        if item.get_closest_marker("engine") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Install the engine before the first test when engine tests are selected."""
    if installed() is not None or not any(
            item.get_closest_marker("engine") for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(msg: str) -> None:
        if reporter is not None:
            reporter.write_line(f"[engine tests] {msg}")

    try:
        install(log=say)
    except EngineError as exc:
        _install_errors.append(str(exc))


@pytest.fixture(scope="session")
def engine_paths() -> EnginePaths:
    """The installed engine (see the module docstring for when it is built)."""
    paths = installed()
    if paths is not None:
        return paths
    msg = "llama.cpp engine unavailable: " + (
        _install_errors[-1] if _install_errors else f"not installed; run `{INSTALL_COMMAND}`")
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{msg} [{REQUIRE_ENV}=1: engine tests must run]", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def llama_server(engine_paths: EnginePaths) -> Iterator[LlamaServer]:
    """A ``llama-server`` on a free port: ``.http_url``, ``.llamacpp_url``, ``.backend``."""
    with LlamaServer(engine_paths, parallel=4) as server:
        yield server
