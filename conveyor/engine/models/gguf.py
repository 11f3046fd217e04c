"""GGUF checkpoints (llama.cpp's one-file format): the config from the file's metadata, the
weights dequantized to float32 at load with the ``gguf`` library, one tensor at a time, under
transformers' names. Where the loader keeps weights quantized (``conveyor.engine.quantization.kept``:
on CUDA), a Q8_0 or Q4_K matrix is handed over as its bytes in the GEMM kernel's layout instead.

What each architecture's metadata and tensor names mean, and how llama.cpp's converter
changed them (Llama's permuted Q/K rows, Gemma's ``1 + weight`` norms, stacked experts...), is
``conveyor.engine.models.gguf_architectures``; this module reads the file with it. Tensor names
are llama.cpp's (``gguf.constants.TENSOR_NAMES``). A mixture of experts stores each layer's
experts stacked (``ffn_{gate,up,down}_exps``, ``[experts, rows, cols]``), split here into the
per-expert tensors of a transformers checkpoint; ``ffn_gate_inp`` is the router.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.engine.distributed.sharding import Shard
from conveyor.engine.models import gguf_architectures
from conveyor.engine.models.gguf_architectures import ARCHITECTURES, GgufArch, unpermute
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.registry import model_class
from conveyor.engine.quantization.kernel_weights import KernelWeight, Q4KWeight, Q8_0Weight

# Stacked experts -> the index of the expert's name in ``MoEForCausalLM.expert_names``.
_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# LongRoPE's factors: read into the spec, not weights.
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_TOP_TENSORS = gguf_architectures.TOP_TENSORS


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
    name = _field(reader, "general.architecture")
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ValueError(f"{file.name}: GGUF architecture {name!r} is not supported; supported: {tuple(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # llama 3.1's frequency factors, stored as a tensor
        raise ValueError(
            f"{file.name}: RoPE frequency factors (rope_freqs.weight: Llama 3.1 scaling) are not supported"
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{name}.{key}", default)

    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    cfg: dict[str, Any] = {
        "model_type": arch.model_type,
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
    head_dim = cfg["head_dim"]
    rotary = meta("rope.dimension_count")
    if rotary and head_dim and rotary != head_dim:
        cfg["partial_rotary_factor"] = rotary / head_dim
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"type": scaling, "factor": meta("rope.scaling.factor")}
    if arch.longrope_factors:
        cfg.update(_longrope_fields(reader, file, meta))
    cfg.update(arch.config(file, meta, names, cfg))
    missing = sorted(k for k, v in cfg.items() if v is None)
    if missing:
        raise ValueError(f"{file.name}: GGUF metadata lacks {missing}")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelSpec.from_dicts(cfg, {"eos_token_id": eos} if eos is not None else {})


def _longrope_fields(reader: Any, file: Path, meta: Any) -> dict[str, Any]:
    """When the file has LongRoPE's factor tensors (Phi-3), the longrope scaling they describe."""
    factors = {t.name: t for t in reader.tensors if t.name in _ROPE_FACTORS}
    if not factors:
        return {}
    original = meta("rope.scaling.original_context_length")
    if len(factors) != 2 or not original:
        raise ValueError(
            f"{file.name}: LongRoPE needs both rope_factors_long and rope_factors_short and "
            "phi3.rope.scaling.original_context_length"
        )
    long, short = (_dequantize(factors[n], file).reshape(-1).tolist() for n in _ROPE_FACTORS)
    return {
        "rope_scaling": {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": original,
        }
    }


def _hf_names(arch: GgufArch, name: str, spec: ModelSpec, experts: int) -> list[str] | None:
    """The transformers names a GGUF tensor holds: one, or one per expert for a stacked
    expert tensor (``None`` for a name we do not know)."""
    stem, _, kind = name.rpartition(".")
    if not stem.startswith("blk."):
        hf = _TOP_TENSORS.get(stem)
        return None if hf is None else [f"{hf}.{kind}"]
    _, layer, part = stem.split(".", 2)
    prefix = f"model.layers.{layer}."
    if part in _EXPERT_TENSORS or part == "ffn_gate_inp":
        cls = model_class(spec)
        assert issubclass(cls, LlamaForCausalLM)  # (GGUF files hold decoders only)
        block = f"{prefix}{cls.mlp_prefix}"
        if part == "ffn_gate_inp":
            return [f"{block}gate.{kind}"]
        expert_name = getattr(cls, "expert_names", ("",) * 3)[_EXPERT_TENSORS[part]]
        return [f"{block}experts.{e}.{expert_name}.{kind}" for e in range(experts)]
    hf = arch.layer_tensors.get(part)
    return None if hf is None else [f"{prefix}{hf}.{kind}"]


def _dequantize(tensor: Any, file: Path, rows: slice | None = None, data: np.ndarray | None = None) -> np.ndarray:
    from gguf import dequantize

    if data is None:
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


def iter_tensors(file: Path, spec: ModelSpec) -> Iterator[tuple[str, str, Callable[[Shard | None], torch.Tensor]]]:
    """(file name, transformers name, reader) for each tensor in the file; a name we do not
    know is passed through as the GGUF name, for the loader to refuse. Nothing is dequantized
    until the loader calls a reader: one tensor (one expert of a stacked one) at a time."""
    reader = _reader(file)
    arch = gguf_architectures.for_model_type(spec.model_type)
    assert arch is not None  # (a GGUF file's spec has one of their model types)
    if not arch.streamed:
        # (renamed, interleaved, merged or reordered in float32: dequantized as read, none kept)
        dequantized = ((t.name, _dequantize(t, file)) for t in reader.tensors)
        for file_name, name, values in gguf_architectures.iter_tensors(arch, file, spec, dequantized):
            yield file_name, name, functools.partial(_shard_of, values)
        return
    experts = spec.moe.num_experts if spec.moe is not None else 0
    permuted, gemma = arch.permuted, arch.norm_plus_one
    for tensor in reader.tensors:
        if tensor.name in _ROPE_FACTORS:
            continue  # already in the spec
        names = _hf_names(arch, tensor.name, spec, experts)
        heads, adjust = None, None
        if permuted and ".attn_q." in tensor.name:
            heads = spec.num_heads
        elif permuted and ".attn_k." in tensor.name:
            heads = spec.num_kv_heads
        elif ".ffn_gate_inp_shexp." in tensor.name:
            adjust = _one_row  # the shared expert's gate: one row (llama.cpp may store a vector)
        elif gemma and tensor.name.endswith("norm.weight"):
            adjust = _minus_one  # stored as Gemma's ``1 + weight``
        if names is None or len(names) == 1:
            yield file.name, tensor.name if names is None else names[0], TensorReader(tensor, file, heads, adjust)
            continue
        if tensor.data.shape[0] != len(names):
            raise ValueError(
                f"{file.name}: {tensor.name} stacks {tensor.data.shape[0]} experts, the metadata {len(names)}"
            )
        for e, name in enumerate(names):
            yield file.name, name, TensorReader(tensor, file, heads, adjust, expert=e)


def _one_row(weights: np.ndarray) -> np.ndarray:
    return weights.reshape(1, -1)


def _minus_one(weights: np.ndarray) -> np.ndarray:
    return weights - 1.0


# The quantization types a GEMM kernel multiplies kept quantized (``conveyor.engine.quantization.kept``).
_KERNEL_TYPES = {"Q8_0": Q8_0Weight.from_blocks, "Q4_K": Q4KWeight.from_blocks}


def _shard_of(values: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    return values if shard is None else shard.take(values)


class TensorReader:
    """One GGUF tensor (or one expert of a stacked one) as the loader reads it. Called: its
    float32 values (or a tensor-parallel shard of them), dequantized then. ``kernel_weight``:
    a Q8_0 or Q4_K matrix's bytes, rows un-permuted as the values are, in its GEMM kernel's
    layout (``None`` for other types, or a tensor whose values are adjusted after dequantizing)."""

    def __init__(
        self,
        tensor: Any,
        file: Path,
        heads: int | None,
        adjust: Callable[[np.ndarray], np.ndarray] | None,
        expert: int | None = None,
    ) -> None:
        self.tensor, self.file, self.heads, self.adjust, self.expert = tensor, file, heads, adjust, expert

    def _rows(self) -> np.ndarray:
        """The stored rows (quantized blocks, or values), Llama's Q/K rows back in transformers' order."""
        data = self.tensor.data if self.expert is None else self.tensor.data[self.expert]
        return data if self.heads is None else unpermute(data, self.heads)

    def __call__(self, shard: Shard | None) -> torch.Tensor:
        weights = _dequantize(self.tensor, self.file, data=self._rows())
        if self.adjust is not None:
            weights = self.adjust(weights)
        full = torch.from_numpy(np.array(weights, dtype=np.float32))
        return full if shard is None else shard.take(full)

    def kernel_weight(self, shard: Shard | None) -> KernelWeight | None:
        split = _KERNEL_TYPES.get(self.tensor.tensor_type.name)
        rows = self._rows()
        if split is None or self.adjust is not None or rows.ndim != 2:
            return None
        return split(torch.from_numpy(np.array(rows, dtype=np.uint8))).take(shard)  # (a copy of the mapped file)


def load_tokenizer(file: Path) -> Any:
    """transformers' tokenizer (chat template included) built from the file's vocabulary.
    transformers builds one only for the architectures its own GGUF loader knows (not
    ``smollm3``, ``glm4moe``, ``deepseek2``, ``qwen35``...): for the others the model's
    tokenizer files must sit beside the file."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except ValueError as exc:  # transformers: "GGUF model with architecture X is not supported yet."
        raise ValueError(
            f"{file.name}: transformers cannot build a tokenizer from this file's vocabulary ({exc}); "
            "put the model's tokenizer files (tokenizer.json, tokenizer_config.json) beside it"
        ) from None
