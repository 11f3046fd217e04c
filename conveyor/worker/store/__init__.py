"""Layer 1: persistence.

Database models, engines, schema migrations, item writes, shard leases, object stores.
"""
