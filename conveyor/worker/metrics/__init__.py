"""Prometheus metrics (``prometheus-client``) of worker processes and the API server.

Between ``execution`` and ``broker``: it observes the layers below (items as a shard stores
them, the engine host's stats, the database) and knows no Celery. ``broker`` serves a
worker's ``/metrics`` (``worker_metrics``); ``api`` mounts ``exposition.ApiMetrics``.
"""
