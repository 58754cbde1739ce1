"""``python -m agentbatch.cli``."""

from agentbatch.cli.app import main

main()
