"""The transformers fallback: transformers' own layers, our paged attention.

For a decoder-only architecture we have no forward pass for (``model_impl="transformers"``, or
``auto`` on an architecture the registry lacks), the model is loaded with
``AutoModelForCausalLM`` and ``attn_implementation=ATTENTION_NAME``: a function registered in
transformers' ``AttentionInterface``. Everything else stays ours: the scheduler, the paged KV
cache, prefix caching, sampling. A step's flat, unpadded batch goes through the model as a batch
of one with ``position_ids`` and no HF cache; each attention layer hands its Q/K/V to our
function, which writes K/V into that layer's paged cache (``module.layer_idx``) and attends
through the engine's attention backend, which knows each request's boundaries and context from
the step's metadata. RoPE, norms, MLPs and the LM head (with any logit scaling) are theirs.

Refused, with an error, rather than computed wrong: encoder-decoders, attention or final logit
soft-capping, attention sinks, and a sliding window smaller than the engine's ``max_model_len``
(the engine keeps its default ``max_model_len`` inside the window).
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.models import family
from conveyor.engine.models.model_config import ModelSpec

ATTENTION_NAME = "conveyor_paged"
# Attention arguments a layer may pass that our backends cannot honour.
_UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "s_aux", "sinks")
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def has_native(path: Path) -> bool:
    """Whether the registry has a forward pass for the checkpoint's architecture (what
    ``model_impl="auto"`` decides by)."""
    cfg = family.language_model_config(_read_config(path))  # (a multimodal one runs its language model)
    names = cfg.get("architectures") or []
    if names:
        return any(name in family.architectures() for name in names)
    return family.config_reader(str(cfg.get("model_type"))) is not None


def resolve_model_impl(path: Path, model_impl: str) -> str:
    """``native`` or ``transformers`` for ``model_impl`` (``auto``, ``native`` or ``transformers``)."""
    if model_impl == "auto":
        return "native" if has_native(path) else "transformers"
    return model_impl


def _read_config(path: Path) -> dict[str, Any]:
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json")
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path / 'config.json'} must hold a JSON object")
    return cfg


def fallback_spec(path: Path) -> ModelSpec:
    """The facts the engine needs (KV cache shape, limits, EOS) from transformers' reading of the
    config; ``ValueError`` for what the fallback cannot run correctly."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"transformers cannot read the config of {path}: {exc}") from exc
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"{hf_config.model_type}: encoder-decoder models are not supported")
    cfg = hf_config.get_text_config()
    if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
        # transformers keeps a linear layer's state in its own cache, per call: not paged, not
        # carried from one step to the next, so every step after the first would be wrong.
        raise ValueError(
            f"{cfg.model_type}: linear-attention (hybrid) layers are not supported by the transformers "
            "fallback; Qwen3.5 and Qwen3-Next run natively (model_impl='native')"
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise ValueError(
                f"{cfg.model_type}: {name}={getattr(cfg, name)} is set; soft-capping is not supported by "
                "the transformers fallback"
            )
    _check_one_kv_shape(cfg)
    num_heads = cfg.num_attention_heads
    hidden = cfg.hidden_size
    max_len = next((getattr(cfg, key) for key in _MAX_LEN_KEYS if getattr(cfg, key, None)), None)
    if max_len is None:
        raise ValueError(f"{cfg.model_type}: the config gives no maximum context length ({', '.join(_MAX_LEN_KEYS)})")
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", getattr(cfg, "eos_token_id", None))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype = getattr(cfg, "dtype", None)
    archs = getattr(hf_config, "architectures", None) or [f"{cfg.model_type} (AutoModelForCausalLM)"]
    return ModelSpec(
        model_type=cfg.model_type,
        architecture=archs[0],
        vocab_size=cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=getattr(cfg, "intermediate_size", None) or 4 * hidden,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(cfg, "head_dim", None) or hidden // num_heads,
        rms_norm_eps=1e-6,  # (the layers are transformers': the fields of our own layers go unused)
        max_position_embeddings=int(max_len),
        rope_theta=10000.0,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        sliding_window=_sliding_window(cfg),
        checkpoint_dtype=dtype if isinstance(dtype, torch.dtype) else None,
        eos_token_ids=eos_ids,
    )


def _check_one_kv_shape(cfg: Any) -> None:
    """The paged cache gives every layer its own K/V of one shape: refuse a config whose layers
    differ in KV heads or head size (Gemma 4's full layers) or read other layers' KV (Gemma 4's
    ``num_kv_shared_layers``), which would otherwise fail mid-step or attend to the wrong keys."""
    shared = getattr(cfg, "num_kv_shared_layers", 0) or 0
    if shared:
        raise ValueError(
            f"{cfg.model_type}: num_kv_shared_layers={shared}: layers that read other layers' KV "
            "are not supported by the transformers fallback"
        )
    per_layer = getattr(cfg, "per_layer_config", None)
    if per_layer is None:
        return
    layers = [per_layer[i] for i in range(cfg.num_hidden_layers)]
    # (a config without the field, such as Granite's head_dim, has one value for every layer)
    shapes = {(getattr(layer, "head_dim", None), getattr(layer, "num_key_value_heads", None)) for layer in layers}
    if len(shapes) > 1:
        found = ", ".join(f"{heads} KV heads of {dim}" for dim, heads in sorted(shapes, key=str))
        raise ValueError(
            f"{cfg.model_type}: its layers have different KV shapes ({found}); the transformers fallback's "
            "cache gives every layer one shape"
        )


def _sliding_window(cfg: Any) -> int | None:
    """The window of the config's sliding-window layers, if any layer uses one."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return None if getattr(cfg, "use_sliding_window", True) is False else int(window)


@dataclass
class _Step:
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    max_len: int


# The step the model is running: set around its forward, read by each attention layer.
_STEP: ContextVar[_Step | None] = ContextVar("conveyor_step", default=None)


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over our paged cache: ``query`` is
    ``[1, num_heads, num_tokens, head_dim]`` (the step's flat batch), ``key``/``value`` the
    same with the KV heads; returns ``[1, num_tokens, num_heads, head_dim]``. The mask
    transformers built (none, for a registered name without a mask function) is ignored: the
    backend masks each request causally within its own context."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError(f"attn_implementation={ATTENTION_NAME!r} runs only inside a conveyor engine step")
    for name in _UNSUPPORTED_ATTENTION_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} passes {name}; the transformers fallback does not support it")
    window = kwargs.get("sliding_window")
    if window is not None and window < step.max_len:
        raise ValueError(
            f"{type(module).__name__} uses a sliding window of {window} tokens, smaller than max_model_len "
            f"{step.max_len}; set max_model_len <= {window}"
        )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx; the transformers fallback needs it")
    k_cache, v_cache = step.kv_caches[layer]
    q = query[0].transpose(0, 1).contiguous()  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(
            f"layer {layer}: keys {tuple(k.shape[1:])} and values {tuple(v.shape[1:])} per token do not "
            f"match the KV cache's (kv heads, head dim) {tuple(k_cache.shape[2:])}"
        )
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.backend.forward(q, k, v, k_cache, v_cache, scale)
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Make ``ATTENTION_NAME`` an ``attn_implementation`` transformers accepts (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)


class _GivenHidden(nn.Module):
    """Stands in for the decoder while the HF head runs on hidden states we already have."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


class TransformersCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind the interface of our native models: ``forward``
    gives the final hidden state of every token of the step, ``compute_logits`` the logits of
    the rows given."""

    def __init__(self, hf_model: nn.Module, spec: ModelSpec, max_len: int) -> None:
        super().__init__()
        self.hf = hf_model
        self.spec = spec
        self.max_len = max_len
        self._prefix: str = hf_model.base_model_prefix  # type: ignore[assignment]
        self._given = _GivenHidden()

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend: AttentionBackend, kv_caches) -> torch.Tensor:
        token = _STEP.set(_Step(backend, kv_caches, self.max_len))
        try:
            decoder = getattr(self.hf, self._prefix)
            out = decoder(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        finally:
            _STEP.reset(token)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The model's own head (logit scaling and all): its forward, with the decoder swapped
        # for the hidden states we have.
        modules = self.hf._modules
        decoder = modules[self._prefix]
        self._given.hidden = hidden.unsqueeze(0)
        modules[self._prefix] = self._given
        try:
            dummy = torch.zeros((1, hidden.shape[0]), dtype=torch.long, device=hidden.device)
            logits = self.hf(input_ids=dummy, use_cache=False).logits
        finally:
            modules[self._prefix] = decoder
            self._given.hidden = None
        return logits[0]


def load_transformers_model(
    path: Path, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device
) -> TransformersCausalLM:
    from transformers import AutoModelForCausalLM

    register_attention()
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=ATTENTION_NAME)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"transformers cannot load {path} as a causal LM: {exc}") from exc
    nn.Module.to(hf_model, device)  # (transformers types its own .to for dtypes and quantization)
    return TransformersCausalLM(hf_model.eval(), spec, max_len)
