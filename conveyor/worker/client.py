"""``from conveyor.worker.client import Client``: the public import path of the Python client, which
lives with the other entry points in ``conveyor.worker.entrypoints.client``."""

from conveyor.worker.entrypoints.client import Client, JobNotFinished

__all__ = ["Client", "JobNotFinished"]
