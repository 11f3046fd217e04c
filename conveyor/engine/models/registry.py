"""Which forward pass runs which architecture, from the families themselves: every module of
``conveyor.engine.models`` that declares a ``FAMILY`` is one (``family.families``), so no list
here names them.

``SUPPORTED_ARCHITECTURES`` (architecture -> ``model_type``) and ``MODEL_CLASSES``
(architecture -> forward pass) are built from them on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.engine.models import family
from conveyor.engine.models.model_config import ModelSpec

if TYPE_CHECKING:
    from conveyor.engine.models.bert import BertEncoder
    from conveyor.engine.models.llama import LlamaForCausalLM


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM] | type[BertEncoder]:
    arch = family.architectures().get(spec.architecture)
    if arch is None:
        supported = ", ".join(family.architectures())
        raise ValueError(f"architecture {spec.architecture!r} is not supported; supported: {supported}")
    return arch.model_class


def __getattr__(name: str) -> Any:
    # (built on first use: the family modules import model_config, which this module imports)
    if name == "SUPPORTED_ARCHITECTURES":
        return family.supported_architectures()
    if name == "MODEL_CLASSES":
        return {name: arch.model_class for name, arch in family.architectures().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
