"""Find a checkpoint (local directory, GGUF file or hub id) and load its weights into our model:
safetensors as they are, or dequantized from the format ``config.json``'s
``quantization_config`` names (``conveyor.engine.quantization``), GGUF dequantized (``conveyor.engine.models.gguf``)."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from conveyor.engine.distributed.sharding import Shard
from conveyor.engine.models import gguf
from conveyor.engine.models.bert import BertEncoder
from conveyor.engine.models.kv_scales import CheckpointKVScales
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.registry import model_class
from conveyor.engine.models.transformers_fallback import (
    TransformersCausalLM,
    fallback_spec,
    load_transformers_model,
    resolve_model_impl,
)
from conveyor.engine.quantization import QuantScheme, scheme_from_config
from conveyor.engine.quantization.kept import KeptWeights, deferred_linears, keeps_quantized
from conveyor.engine.quantization.loading import dequantized

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
# gpt-oss's repositories also ship the weights again in OpenAI's own format (``original/``) and
# for Metal (``metal/``), which the loader never reads: as large as the checkpoint itself.
_HUB_IGNORED = ["original/*", "metal/*"]
# Tensors some checkpoints carry that the forward pass recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# An encoder's pooler head (sentence-transformers never runs it) and its stored position ids.


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory or ``.gguf`` file as is; anything else is a hub id, downloaded (or
    found in the local hub cache) with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ValueError(f"model path {model!r} is not a directory or a .gguf file")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id=model, revision=revision, allow_patterns=_HUB_PATTERNS, ignore_patterns=_HUB_IGNORED
            )
        )
    except Exception as exc:  # many hub/network error types; say which model
        raise ValueError(f"could not find model {model!r} locally or on the hub: {exc}") from exc


# Any of these in a checkpoint is a tokenizer transformers' AutoTokenizer can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: Path) -> Any:
    """transformers' tokenizer for the checkpoint at ``path``. A GGUF checkpoint uses tokenizer
    files beside it when its directory holds some (faster to load), else its own vocabulary."""
    from transformers import AutoTokenizer

    file = gguf.find_gguf(path)
    if file is not None and not _has_tokenizer_files(file.parent):
        return gguf.load_tokenizer(file)
    return AutoTokenizer.from_pretrained(str(file.parent if file is not None else path))


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def check_checkpoint(path: Path) -> ModelSpec:
    """What loading ``path`` would reject, found without loading a tensor: a ``config.json``
    that parses and names a supported architecture, safetensors files whose headers read, a
    tokenizer; for GGUF, metadata naming a supported architecture and tensors of quantization
    types we can dequantize. ``ValueError`` names the file and the problem. The architecture is
    checked as ``model_impl="auto"`` would load it: natively, else through the transformers fallback."""
    file = gguf.find_gguf(path)
    if file is not None:
        spec = gguf.read_spec(file)
        gguf.check_tensors(file)
        return spec
    spec, _ = load_spec(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                f.keys()
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None
    if not _has_tokenizer_files(path):
        raise ValueError(f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    return spec


def load_spec(path: Path, model_impl: str = "auto", quantization: str | None = None) -> tuple[ModelSpec, str]:
    """The checkpoint's spec and whose forward pass runs it (``native`` or ``transformers``)
    for ``model_impl`` (``EngineConfig.model_impl``). ``native`` on an architecture the
    registry lacks raises the registry's error. A GGUF checkpoint runs natively only.
    ``quantization`` (``EngineConfig.quantization``), when given, must be the checkpoint's."""
    file = gguf.find_gguf(path)
    if quantization is not None:
        found = "gguf" if file is not None else (s.method if (s := quant_scheme(path)) is not None else None)
        if found != quantization:
            raise ValueError(
                f"quantization={quantization!r}, but {path} is "
                + (f"quantized with {found!r}" if found else "not quantized")
                + "; Conveyor loads a checkpoint as it was quantized and never quantizes one on load"
            )
    if file is not None:
        if model_impl == "transformers":
            raise ValueError(f"{file.name}: a GGUF checkpoint runs natively only, not with model_impl='transformers'")
        return gguf.read_spec(file), "native"
    impl = resolve_model_impl(path, model_impl)
    scheme = quant_scheme(path)
    if scheme is not None and impl == "transformers":
        raise ValueError(
            f"{path}: a {scheme.method!r} quantized checkpoint runs natively only; "
            "this architecture has no native forward pass"
        )
    return (fallback_spec(path) if impl == "transformers" else ModelSpec.from_pretrained(path)), impl


def quant_scheme(path: Path) -> QuantScheme | None:
    """The quantization scheme ``config.json``'s ``quantization_config`` names, or ``None``;
    ``ValueError`` for a scheme or option we cannot dequantize exactly."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # ModelSpec reports a missing or broken config.json
    return scheme_from_config(config) if isinstance(config, dict) else None


def load_model(
    path: Path,
    spec: ModelSpec,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
    model_impl: str = "native",
    kv_cache_dtype: str = "auto",
) -> LlamaForCausalLM | BertEncoder | TransformersCausalLM:
    if model_impl == "transformers":
        return load_transformers_model(path, spec, max_len, dtype, device)
    file = gguf.find_gguf(path)
    scheme = None
    if file is not None:
        tensors: Iterator[tuple[str, str, Reader]] = gguf.iter_tensors(file, spec)
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} has no *.safetensors weights")
        scheme = quant_scheme(path)
        tensors = _safetensors(files) if scheme is None else _dequantized_safetensors(files, scheme)
    # A quantized checkpoint's linear weights get memory only should they stay dequantized.
    with deferred_linears(keeps_quantized(device) and (file is not None or scheme is not None)):
        model = model_class(spec)(spec, max_len, dtype, device)
    slots = model.weight_slots()
    missing = set(slots)
    kept = KeptWeights(model, device)
    kv_scales = CheckpointKVScales(spec.num_kv_heads)
    for source, checkpoint_name, read in tensors:
        name = model.checkpoint_name(checkpoint_name)
        if name is None:
            continue
        if name.endswith(_IGNORED_SUFFIXES) or kv_scales.take(name, read):
            continue
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        if name not in slots:
            raise ValueError(f"{source}: unexpected tensor {name!r} for a {spec.model_type} model")
        target, offset, rows, *shard = slots[name]
        missing.discard(name)
        # Under tensor parallelism, this rank's rows or columns of the checkpoint tensor only.
        part = shard[0] if shard else None
        dense = kept.take(target, offset, rows, read, part)
        if dense is None:
            continue  # kept quantized: no float copy read
        tensor = read(part)
        if tensor.shape[0] != rows or tensor.shape[1:] != dense.shape[1:]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the config")
        # (into the tensor's own dtype: the model's, or float32 where a layer keeps it, as DeepSeek's router)
        dense.data[offset : offset + rows].copy_(tensor.to(dense.dtype))
    if missing:
        raise ValueError(f"{path}: weights missing from the checkpoint: {sorted(missing)[:5]}")
    kv_scales.install(model, kv_cache_dtype)
    kept.install()
    return model.eval()


# Reads a checkpoint tensor, or only the given ``Shard`` of it.
Reader = Callable[[Shard | None], torch.Tensor]


def _safetensors(files: list[Path]) -> Iterator[tuple[str, str, Reader]]:
    """Each tensor's reader, called before the next is yielded (while its file is open): a
    tensor-parallel rank reads only its shard from the file."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys() but is not iterable
                yield file.name, name, functools.partial(_read_safetensor, f, name)


def _read_safetensor(f: Any, name: str, shard: Shard | None) -> torch.Tensor:
    if shard is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    dim = shard.dim

    def part(start: int, size: int) -> torch.Tensor:
        return view[(slice(None),) * dim + (slice(start, start + size),)]

    return shard.read(tuple(view.get_shape()), lambda: f.get_tensor(name), part)


def _dequantized_safetensors(files: list[Path], scheme: QuantScheme) -> Iterator[tuple[str, str, Reader]]:
    """A quantized checkpoint's tensors through ``scheme``: the files stay open while it is
    read, since a quantized weight's parts (scales, zeros) may sit in another file."""
    with contextlib.ExitStack() as stack:
        handles = {file.name: stack.enter_context(safe_open(str(file), framework="pt", device="cpu")) for file in files}
        sources = {name: source for source, f in handles.items() for name in f.keys()}  # noqa: SIM118
        yield from dequantized(scheme, sources, lambda name: handles[sources[name]].get_tensor(name))
