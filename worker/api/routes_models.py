"""``/v1/models``: the models that live workers serve now (OpenAI's model objects).

A model is listed while at least one worker serving it is ``ready`` with a heartbeat in the
last ``CONVEYOR_WORKER_LIVE_SECONDS``; its id is the name batches use in ``body.model`` (the
worker's ``--served-model-name``, else its ``--model``), ``created`` when its longest-running
worker started.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from worker.api.auth import Caller
from worker.api.errors import not_found
from worker.api.services import Services
from worker.store.workers import served_models

router = APIRouter(prefix="/v1/models", tags=["models"])

OWNED_BY = "conveyor"


def model_object(model: str, since: float) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": int(since), "owned_by": OWNED_BY}


@router.get("")
def list_models(_owner: Caller, services: Services) -> dict[str, Any]:
    models = served_models(services.db, services.settings.worker_live_seconds)
    return {"object": "list", "data": [model_object(m, since) for m, since in models]}


@router.get("/{model_id:path}")
def retrieve_model(model_id: str, _owner: Caller, services: Services) -> dict[str, Any]:
    for model, since in served_models(services.db, services.settings.worker_live_seconds):
        if model == model_id:
            return model_object(model, since)
    raise not_found(f"The model '{model_id[:256]}' does not exist or no worker serves it now.", param="model")
