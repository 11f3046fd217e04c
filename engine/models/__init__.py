"""Our own forward passes over Hugging Face configs and safetensors weights."""

from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model, resolve_model_path
from engine.models.model_config import ModelSpec

__all__ = ["LlamaForCausalLM", "ModelSpec", "load_model", "resolve_model_path"]
