"""The core: agent state, plan, options, the pure turn state machine, results and errors.

Imports nothing else of the package (tests/unit/test_import_layers.py), so either engine,
a backend or a tool can use it without pulling in the other layers.
"""
