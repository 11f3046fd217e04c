"""``from worker.client import Client``: the public import path of the Python client, which
lives with the other entry points in ``worker.entrypoints.client``."""

from worker.entrypoints.client import Client, JobNotFinished

__all__ = ["Client", "JobNotFinished"]
