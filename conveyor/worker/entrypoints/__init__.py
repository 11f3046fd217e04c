"""Layer 6: what users run.

The CLI, the Python client, the in-process runner (``conveyor run``).
"""
