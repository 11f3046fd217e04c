"""Persistence: the database (db, items, leases, schema) and object storage (objects)."""
