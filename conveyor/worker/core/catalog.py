"""The deployment's model catalog as configured (``CONVEYOR_MODELS``): the public model names it
serves, checked when the settings are read.

A name is what jobs record as their model: a worker's ``--served-model-name`` or a hub id
(``Qwen/Qwen3-0.6B``), an ``s3://bucket/prefix/`` URI, or a local checkpoint's absolute path.
``conveyor.worker.jobs.catalog`` decides with it which models are accepted while no worker runs.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_CATALOG_MODELS = 64
# The width of the ``jobs.model`` and ``workers.model`` columns.
MAX_MODEL_CHARS = 256
# A hub id or a served name: ``name`` or ``org/name`` of letters, digits, ``.``, ``_`` and ``-``.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_URI_OR_PATH = re.compile(r"^(s3://[^\s,]+|/[^\s,]*)$")


def parse_catalog(value: Any) -> tuple[str, ...]:
    """``CONVEYOR_MODELS`` (names separated by commas, or a JSON list) as a tuple of distinct
    names in their order; ``ValueError`` naming the entry at fault."""
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"not a valid JSON list ({exc})") from None
        else:
            value = [part.strip() for part in text.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be model names separated by commas, or a JSON list of them")
    names = list(dict.fromkeys(v.strip() for v in value if v.strip()))
    if len(names) > MAX_CATALOG_MODELS:
        raise ValueError(f"declares {len(names)} models; at most {MAX_CATALOG_MODELS}")
    for name in names:
        if len(name) > MAX_MODEL_CHARS:
            raise ValueError(f"the model name {name[:80]!r}... is longer than {MAX_MODEL_CHARS} characters")
        if not (HUB_ID.match(name) or _URI_OR_PATH.match(name)):
            raise ValueError(
                f"{name[:80]!r} is not a model name: give served names or hub ids (letters, digits, '.', '_', '-', "
                "at most one '/'), s3://bucket/prefix/ URIs or absolute paths, separated by commas"
            )
    return tuple(names)
