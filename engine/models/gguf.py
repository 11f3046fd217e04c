"""GGUF checkpoints (llama.cpp's one-file format): the config from the file's metadata, the
weights dequantized to float32 at load with the ``gguf`` library, under transformers' names.

llama.cpp's converter permutes the rows of a Llama model's Q and K projections (its RoPE pairs
neighbouring elements where transformers pairs the two halves of a head); the loader undoes
that, as transformers' own GGUF loader does. Qwen2 and Qwen3 files are written unpermuted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.model_config import ModelSpec

# GGUF's ``general.architecture`` -> our model_type. Mistral checkpoints are written as llama.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor names (after ``blk.N.``) -> transformers' names (after ``model.layers.N.``).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``*.gguf`` in a directory
    without a ``config.json``. ``None`` for an ordinary (safetensors) checkpoint."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"{path} holds {len(files)} GGUF files ({names}); name the one to load")
    return files[0] if files else None


# The last file read: parsing the metadata (a vocabulary's every token is a field part) takes
# seconds, and a load reads the same file for its spec, then for its tensors.
_last_reader: tuple[tuple[str, int, int], Any] | None = None


def _reader(file: Path) -> Any:
    global _last_reader
    from gguf import GGUFReader

    stat = file.stat()
    key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    if _last_reader is not None and _last_reader[0] == key:
        return _last_reader[1]
    try:
        reader = GGUFReader(str(file))
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError... on a damaged file
        raise ValueError(f"{file} is not a readable GGUF file: {exc}") from None
    _last_reader = (key, reader)
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_spec(file: Path, reader: Any = None) -> ModelSpec:
    """The ``ModelSpec`` a GGUF file's metadata describes (checked as a config.json is)."""
    reader = reader if reader is not None else _reader(file)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{file.name}: GGUF architecture {arch!r} is not supported; supported: {tuple(GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # llama 3.1's frequency factors, stored as a tensor
        raise ValueError(
            f"{file.name}: RoPE frequency factors (rope_freqs.weight: Llama 3.1 scaling) are not supported"
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    if meta("expert_count"):  # llama.cpp writes Mixtral as llama, with merged expert tensors
        raise ValueError(f"{file.name}: GGUF mixture-of-experts ({meta('expert_count')} experts) is not supported")

    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "model_type": GGUF_ARCHITECTURES[arch],
        "vocab_size": meta("vocab_size") or (len(tokens) if tokens is not None else None),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "head_dim": meta("attention.key_length") or (hidden // num_heads if hidden and num_heads else None),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": meta("context_length", 4096),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"type": scaling, "factor": meta("rope.scaling.factor")}
    missing = sorted(k for k, v in cfg.items() if v is None)
    if missing:
        raise ValueError(f"{file.name}: GGUF metadata lacks {missing}")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelSpec.from_dicts(cfg, {"eos_token_id": eos} if eos is not None else {})


def _hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        hf = _LAYER_TENSORS.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    hf = _TOP_TENSORS.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows: per head, (dim/2, 2) back to (2, dim/2)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: Any, file: Path, rows: slice | None = None) -> np.ndarray:
    from gguf import dequantize

    data = tensor.data if rows is None else tensor.data[rows]
    try:
        return dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{file.name}: tensor {tensor.name} has quantization type {tensor.tensor_type.name}, "
            "which the gguf library cannot dequantize"
        ) from None


def check_tensors(file: Path, reader: Any = None) -> None:
    """Every tensor's quantization type can be dequantized (tried on one row of each type)."""
    reader = reader if reader is not None else _reader(file)
    seen = set()
    for tensor in reader.tensors:
        if tensor.tensor_type not in seen:
            seen.add(tensor.tensor_type)
            _dequantize(tensor, file, slice(0, 1))


def iter_tensors(file: Path, spec: ModelSpec) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, transformers name, float32 tensor) for each tensor in the file; a name we
    do not know is passed through as the GGUF name, for the loader to refuse."""
    reader = _reader(file)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        weights = _dequantize(tensor, file)
        if spec.model_type == "llama" and ".attn_q." in tensor.name:
            weights = _unpermute(weights, spec.num_heads)
        elif spec.model_type == "llama" and ".attn_k." in tensor.name:
            weights = _unpermute(weights, spec.num_kv_heads)
        yield file.name, (name or tensor.name), torch.from_numpy(np.array(weights, dtype=np.float32))


def load_tokenizer(file: Path) -> Any:
    """transformers' tokenizer (chat template included) built from the file's vocabulary."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
