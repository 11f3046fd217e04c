"""Our own forward passes over Hugging Face configs and safetensors weights.

- ``model_config``: ``ModelSpec``, the architecture facts read from a checkpoint's config.
- ``llama``: the Llama family forward pass (Llama 2/3, Mistral, Qwen2, Qwen3), and the layers
  other families share (RMSNorm, rotary embedding, attention, MLP).
- ``phi3``: Phi-3 / Phi-4 (fused checkpoint projections, LongRoPE, partial rotary).
- ``registry``: which forward pass runs which checkpoint ``architectures`` entry.
- ``loader``: finding a checkpoint (local directory or hub id) and loading its weights.

Import each name from the module that defines it: this package re-exports nothing.
"""
