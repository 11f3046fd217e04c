"""Quantized checkpoints: ``config.json``'s ``quantization_config`` names a scheme
(``registry``), one module per format. Loading dequantizes each quantized tensor to the float
tensor the unquantized model holds, one tensor at a time (``loading``)."""

from conveyor.engine.quantization.base import QuantizedTensor, QuantScheme
from conveyor.engine.quantization.registry import SCHEMES, scheme_from_config

__all__ = ["SCHEMES", "QuantScheme", "QuantizedTensor", "scheme_from_config"]
