"""Layer 5: Celery.

The broker contract (task names, queues, enqueue), configuration, tasks, the worker process and its app.
"""
