"""The OpenAI-compatible HTTP API (``conveyor serve``): Files, Batches and Models under ``/v1``,
API keys, ``/healthz`` and ``/readyz``. The app factory is ``conveyor.worker.api.app.create_app``."""
