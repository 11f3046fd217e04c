"""The quantization schemes by ``quant_method``; an unknown one is refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.engine.quantization.awq import AwqScheme
from conveyor.engine.quantization.base import QuantScheme
from conveyor.engine.quantization.compressed_tensors import CompressedTensorsScheme
from conveyor.engine.quantization.fp8 import Fp8Scheme
from conveyor.engine.quantization.gptq import GptqScheme
from conveyor.engine.quantization.mxfp4 import Mxfp4Scheme

SCHEMES: dict[str, type[QuantScheme]] = {
    scheme.method: scheme for scheme in (Fp8Scheme, CompressedTensorsScheme, AwqScheme, GptqScheme, Mxfp4Scheme)
}


# Methods whose note transformers keeps in a safetensors checkpoint's config.json over float
# weights: a model loaded from a GGUF file and saved with ``save_pretrained`` (transformers 5.25)
# writes its weights dequantized and loads them back as they are.
FLOAT_WEIGHTS_METHODS = ("gguf",)


def scheme_from_config(config: Mapping[str, Any]) -> QuantScheme | None:
    """The scheme of a ``config.json`` (as a dict); ``None`` when it has no ``quantization_config``
    or its weights are floats whatever it says (``FLOAT_WEIGHTS_METHODS``)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method in FLOAT_WEIGHTS_METHODS:
        return None
    if method not in SCHEMES:
        raise ValueError(
            f"quantization_config: quant_method {quant.get('quant_method')!r} is not supported "
            f"(supported: {', '.join(sorted(SCHEMES))})"
        )
    return SCHEMES[method](quant)
