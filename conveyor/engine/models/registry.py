"""Which family reads which config, and which forward pass runs which architecture, found from
the families themselves: every module of ``conveyor.engine.models`` that declares a
``FAMILY`` (``conveyor.engine.models.family``) is one, so no list here names them.

``SUPPORTED_ARCHITECTURES`` (architecture -> ``model_type``) and ``MODEL_CLASSES``
(architecture -> forward pass) are built from them on first use."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conveyor.engine.models.family import Architecture, Family
from conveyor.engine.models.model_config import CheckpointConfig, ModelSpec

if TYPE_CHECKING:
    from conveyor.engine.models.bert import BertEncoder
    from conveyor.engine.models.llama import LlamaForCausalLM


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family this package's modules declare: the reference family first, the others in
    their modules' order."""
    package = importlib.import_module("conveyor.engine.models")
    found = []
    for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
        family = getattr(importlib.import_module(f"{package.__name__}.{module}"), "FAMILY", None)
        if isinstance(family, Family):
            found.append(family)
    return tuple(sorted(found, key=lambda f: not f.listed_first))


@functools.cache
def architectures() -> dict[str, Architecture]:
    """Each supported ``architectures`` entry, in the families' order."""
    out: dict[str, Architecture] = {}
    for family in families():
        for arch in family.architectures:
            if arch.name in out:
                raise RuntimeError(f"architecture {arch.name} is declared by two families")
            out[arch.name] = arch
    return out


@functools.cache
def _readers() -> dict[str, Callable[[CheckpointConfig], ModelSpec]]:
    return {model_type: f.read_config for f in families() for model_type in f.model_types}


@functools.cache
def _wrappers() -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    return {wrapper: unwrap for f in families() for wrapper, unwrap in f.wrappers.items()}


def config_reader(model_type: str) -> Callable[[CheckpointConfig], ModelSpec] | None:
    """The reader of the family that lists ``model_type`` (None: no family does)."""
    return _readers().get(model_type)


def language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's config (its ``text_config`` inside) as its language model's
    config, by the family that serves the wrapper; any other config as it is."""
    unwrap = _wrappers().get(str(cfg.get("model_type")))
    return unwrap(cfg) if unwrap is not None and isinstance(cfg.get("text_config"), dict) else cfg


def supported_architectures() -> dict[str, str]:
    """Each supported ``architectures`` entry -> its ``model_type``."""
    return {name: arch.model_type for name, arch in architectures().items()}


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM] | type[BertEncoder]:
    arch = architectures().get(spec.architecture)
    if arch is None:
        raise ValueError(
            f"architecture {spec.architecture!r} is not supported; supported: {', '.join(architectures())}"
        )
    return arch.model_class


def __getattr__(name: str) -> Any:
    # (built on first use: the family modules import this package's model_config, so they
    # cannot all be imported while it loads)
    if name == "SUPPORTED_ARCHITECTURES":
        return supported_architectures()
    if name == "MODEL_CLASSES":
        return {name: arch.model_class for name, arch in architectures().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
