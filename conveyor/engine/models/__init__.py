"""Our own forward passes over Hugging Face configs and safetensors weights.

- ``family``: what a family module declares (``FAMILY``: its architectures, forward passes and
  config reader), and the families found by scanning this package's modules.
- ``model_config``: ``ModelSpec``, and what every family reads alike from a config.
- ``registry``: which forward pass runs which checkpoint ``architectures`` entry.
- ``layers``: the layers the decoder families share (RMSNorm, rotary embedding, attention, MLP).
- one module a family: ``llama`` (Llama 2/3, Mistral, Qwen2, Qwen3, and the decoder the others
  extend), ``phi3``, ``moe``, ``gemma``, ``gemma4``, ``qwen3_5``, ``deepseek``, ``bert``...
- ``loader``: finding a checkpoint (local directory or hub id) and loading its weights.

Import each name from the module that defines it: this package re-exports nothing.
"""
