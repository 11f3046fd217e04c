"""Layer 4: running shards.

The engine host (one engine per process), the worker context, the shard runner, item records.
"""
