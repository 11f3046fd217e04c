"""What a model family declares about itself, in its own module, as ``FAMILY = Family(...)``:
the checkpoint ``architectures`` it serves (each with its ``model_type`` and the forward pass
that runs it) and the function that reads its ``config.json`` into a ``ModelSpec``. The
checkpoint's tensor names are the forward pass's own (its ``weight_slots``).

``conveyor.engine.models.registry`` finds every module of this package that declares one, so
adding a family is adding its module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.engine.models.bert import BertEncoder
    from conveyor.engine.models.llama import LlamaForCausalLM
    from conveyor.engine.models.model_config import CheckpointConfig, ModelSpec


@dataclass(frozen=True)
class Architecture:
    """One ``architectures`` entry of a checkpoint's config, its ``model_type`` and the forward
    pass that runs it: a decoder (the Llama decoder or one extending it) or the encoder."""

    name: str
    model_type: str
    model_class: type[LlamaForCausalLM] | type[BertEncoder]


@dataclass(frozen=True)
class Family:
    """A family: its architectures (the first for each ``model_type`` is the base model a
    config without ``architectures`` gets; a head such as a classifier comes after), the
    reader of its configs (called for every config whose ``model_type`` it lists, after
    transformers' defaults are filled in), and the multimodal wrappers it serves by their
    language model: the wrapper's ``model_type`` -> the function turning the wrapper's config
    into its language model's."""

    architectures: tuple[Architecture, ...]
    read_config: Callable[[CheckpointConfig], ModelSpec]
    wrappers: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]] = field(default_factory=dict)
    # The reference family the others extend (Llama): listed first where refusals name the
    # supported architectures.
    listed_first: bool = False

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.model_type for a in self.architectures))
