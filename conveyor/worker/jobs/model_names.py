"""Model ids: canonical (a job and its workers agree on it) and broker-safe (a slug).

A job names its model by hub id (``Qwen/Qwen3-0.6B``), local directory or object-store
prefix (``s3://bucket/prefix/``, which the worker downloads: ``store/model_cache.py``). The id is made
canonical once (a local directory becomes its absolute path) so that ``submit`` and
``worker`` agree on it. Each model's queue is named from its slug, which keeps only characters
every broker accepts (RabbitMQ, Redis, SQS: letters, digits, ``_`` and ``-``) plus a short
hash of the full id whenever the slug had to change it.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from conveyor.worker.core.catalog import HUB_ID as _HUB_ID
from conveyor.worker.core.storable_text import check_storable
from conveyor.worker.store.model_cache import canonical_model_uri, is_model_uri
from conveyor.worker.store.models import MODEL_LEN

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
MAX_SLUG = 48


class InvalidModel(ValueError):
    """A model id that is neither an existing directory nor a well-formed hub id."""


def canonical_model(model: str) -> str:
    """An existing local directory -> its absolute path; a hub id -> itself (checked); an
    ``s3://bucket/prefix`` URI -> itself with one trailing slash."""
    if not isinstance(model, str) or not model.strip():
        raise InvalidModel("the model must be a hub id (org/name), a local directory or s3://bucket/prefix/")
    check_storable(model, "model")
    model = model.strip()
    if len(model) > MODEL_LEN:
        raise InvalidModel(f"the model id is longer than {MODEL_LEN} characters: {model[:80]}...")
    if is_model_uri(model):  # weights in an object store: s3://bucket/prefix/, always with the slash
        try:
            uri = canonical_model_uri(model)
        except ValueError as exc:
            raise InvalidModel(str(exc)) from None
        if len(uri) > MODEL_LEN:
            raise InvalidModel(f"the model URI is longer than {MODEL_LEN} characters: {uri[:80]}...")
        return uri
    path = Path(model).expanduser()
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError:  # e.g. a name too long for the filesystem
        is_dir = exists = False
    if is_dir or (exists and path.suffix == ".gguf"):  # a checkpoint directory, or one GGUF file
        resolved = str(path.resolve())
        if len(resolved) > MODEL_LEN:
            raise InvalidModel(f"the model path is longer than {MODEL_LEN} characters: {resolved[:80]}...")
        return resolved
    if exists:
        raise InvalidModel(f"the model path {model!r} is a file; give the checkpoint's directory or a .gguf file")
    if model.startswith(("/", ".", "~")) or not _HUB_ID.match(model) or len(model) > MODEL_LEN:
        raise InvalidModel(f"model {model!r} is not a local directory nor a hub id like 'Qwen/Qwen3-0.6B'")
    return model


def check_served_name(name: str) -> str:
    """A public model name (``conveyor worker --served-model-name``): a hub-id-like name
    (``tiny``, ``org/name``: letters, digits, ``.``, ``_``, ``-``), never a path."""
    if not isinstance(name, str) or not _HUB_ID.match(name) or len(name) > MODEL_LEN:
        raise InvalidModel(
            f"served model name {name!r:.80} must be letters, digits, '.', '_' or '-', with at most one '/' "
            "(like 'llama-3-8b' or 'org/llama-3-8b')"
        )
    return name


def model_slug(model: str) -> str:
    """A broker-safe name for ``model`` (already canonical)."""
    base = model.rstrip("/")
    if base.startswith("/"):  # a local path: its last two parts say enough
        base = "-".join(Path(base).parts[-2:])
    slug = _UNSAFE.sub("_", base).strip("_-")[:MAX_SLUG] or "model"
    if slug != model:
        slug += "-" + hashlib.blake2b(model.encode("utf-8"), digest_size=4).hexdigest()
    return slug
