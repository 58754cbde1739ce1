"""The ``agentbatch`` command (``python -m agentbatch.cli``)."""

from agentbatch.cli.app import app, main

__all__ = ["app", "main"]
