"""What a model family declares about itself, in its own module, as ``FAMILY = Family(...)``:
the checkpoint ``architectures`` it serves (each with its ``model_type`` and the forward pass
that runs it) and the function that reads its ``config.json`` into a ``ModelSpec``. The
checkpoint's tensor names are the forward pass's own (its ``weight_slots``).

``families()`` finds every module of this package that declares one, so adding a family is
adding its module. This module imports none of the package's: the families and
``model_config`` import it (``registry`` gives the typed lookups on top)."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_PACKAGE = __name__.rpartition(".")[0]


@dataclass(frozen=True)
class CheckpointConfig:
    """What a family's ``read_config`` reads: the config (transformers' defaults filled in),
    the supported architecture it names, and the EOS ids (``generation_config.json``'s first)."""

    values: dict[str, Any]
    architecture: str
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Architecture:
    """One ``architectures`` entry of a checkpoint's config, its ``model_type`` and the forward
    pass that runs it (``__init__(spec, max_len, dtype, device)``): a decoder extending
    ``llama.LlamaForCausalLM``, or ``bert.BertEncoder``."""

    name: str
    model_type: str
    model_class: type


@dataclass(frozen=True)
class Family:
    """A family: its architectures (the first for each ``model_type`` is the base model a
    config without ``architectures`` gets; a head such as a classifier comes after), the
    reader of its configs into a ``ModelSpec`` (called for every config whose ``model_type`` it
    lists, after transformers' defaults are filled in), and the multimodal wrappers it serves
    by their language model: the wrapper's ``model_type`` -> the function turning the wrapper's
    config into its language model's."""

    architectures: tuple[Architecture, ...]
    read_config: Callable[[CheckpointConfig], object]
    wrappers: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]] = field(default_factory=dict)
    # The reference family the others extend (Llama): listed first where refusals name the
    # supported architectures.
    listed_first: bool = False

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.model_type for a in self.architectures))


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family this package's modules declare: the reference family first, the others in
    their modules' order. (Imported here by name, found by scanning: no list names them.)"""
    package = importlib.import_module(_PACKAGE)
    found = []
    for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
        family = getattr(importlib.import_module(f"{_PACKAGE}.{module}"), "FAMILY", None)
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


def supported_architectures() -> dict[str, str]:
    """Each supported ``architectures`` entry -> its ``model_type``."""
    return {name: arch.model_type for name, arch in architectures().items()}


@functools.cache
def _readers() -> dict[str, Callable[[CheckpointConfig], object]]:
    return {model_type: f.read_config for f in families() for model_type in f.model_types}


@functools.cache
def _wrappers() -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    return {wrapper: unwrap for f in families() for wrapper, unwrap in f.wrappers.items()}


def config_reader(model_type: str) -> Callable[[CheckpointConfig], object] | None:
    """The reader of the family that lists ``model_type`` (None: no family does)."""
    return _readers().get(model_type)


def language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's config (its ``text_config`` inside) as its language model's
    config, by the family that serves the wrapper; any other config as it is."""
    unwrap = _wrappers().get(str(cfg.get("model_type")))
    return unwrap(cfg) if unwrap is not None and isinstance(cfg.get("text_config"), dict) else cfg


def clear_cache() -> None:
    """Forget the families found (a test adding a family module on the package's path)."""
    for cached in (families, architectures, _readers, _wrappers):
        cached.cache_clear()
