"""The embedded engine: the turn loop run in-process on asyncio, with checkpoints and its own
``/metrics``."""
