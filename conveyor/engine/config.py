"""Engine configuration: validated up front, and the KV-cache sizing derived from memory."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from conveyor.engine.core.admission import ADMISSION_POLICIES
from conveyor.engine.core.waiting_queues import SCHEDULING_POLICIES
from conveyor.engine.runner.cpu_threads import check_cpu_threads
from conveyor.engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from conveyor.engine.models.model_config import ModelSpec

ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Whose forward pass runs the model: ``native`` (ours, ``conveyor.engine.models.registry``),
# ``transformers`` (transformers' layers with our paged attention plugged in,
# ``conveyor.engine.models.transformers_fallback``), or ``auto``: native when we have the architecture.
MODEL_IMPLS = ("auto", "native", "transformers")
# What ``quantization`` may name: ``conveyor.engine.quantization.registry``'s methods, and GGUF.
QUANTIZATIONS = ("awq", "compressed-tensors", "fp8", "gguf", "gptq", "mxfp4")
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
# On CPU, with no explicit budget, the KV cache holds as many bytes as the weights (see
# ``cpu_default_kv_bytes``), and never more than this share of available RAM or this cap.
CPU_KV_CACHE_RAM_FRACTION = 0.25
CPU_KV_CACHE_MAX_BYTES = 4 << 30
# ... nor more than ``max_num_seqs`` sequences of this many tokens (prompt and output of a
# typical batch request) would use.
CPU_KV_TOKENS_PER_SEQ = 512


def _check_positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    """Which model, and how its forward pass runs."""

    # A local checkpoint directory or a hub id.
    model: str
    # The tokenizer's directory or hub id, when it is not the model's.
    tokenizer: str | None = None
    # The hub revision (branch, tag or commit) of the model and tokenizer.
    revision: str | None = None
    # float32, float16 or bfloat16 (and their aliases); auto: float32 on CPU, else the checkpoint's half type.
    dtype: str = "auto"
    # cpu, cuda, cuda:N; auto: CUDA when available.
    device: str = "auto"
    # The sampler's seed for requests without their own.
    seed: int = 0
    # The longest sequence (prompt and output); None: the model's limit.
    max_model_len: int | None = None
    # The quantization the checkpoint must carry (``QUANTIZATIONS``: its config.json's quant_method,
    # or gguf); None: whatever it has. A check, not a conversion: nothing is quantized on load.
    quantization: str | None = None
    # native, transformers or auto (``MODEL_IMPLS``).
    model_impl: str = "auto"
    # torch, triton or auto (``ATTENTION_BACKENDS``).
    attention_backend: str = "auto"
    # CUDA graphs for decode batches (GPU, triton backend) are off with this.
    enforce_eager: bool = False
    # Batches of up to this many decodes are captured as CUDA graphs; larger ones run eagerly.
    cuda_graph_max_batch_size: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a local directory or a hub id, got {self.model!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check_positive_int(self.cuda_graph_max_batch_size, "cuda_graph_max_batch_size")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")


@dataclass
class CacheConfig:
    """The paged KV cache: its blocks, their number, and prefix caching."""

    # Tokens per KV block: a power of two from 1 to 128.
    block_size: int = 16
    # Requests sharing a prefix reuse its cached blocks.
    enable_prefix_caching: bool = True
    # On CUDA, the share of the device's memory the engine may fill (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.9
    # The KV cache's memory, in bytes, on any device (instead of gpu_memory_utilization on
    # CUDA, or the model-derived default on CPU); num_kv_blocks, when set, wins over both.
    kv_cache_memory_bytes: int | None = None
    # Exactly this many KV blocks, whatever the memory.
    num_kv_blocks: int | None = None
    # The KV cache's element type: "auto" (the model's dtype) or "fp8" (e4m3 with a scale of 1:
    # one byte an element, twice bf16's tokens in the same memory; both attention backends read it).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two from 1 to 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and (
            isinstance(self.kv_cache_memory_bytes, bool)
            or not isinstance(self.kv_cache_memory_bytes, int)
            or self.kv_cache_memory_bytes < 1
        ):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")


@dataclass
class SchedulerConfig:
    """What each step may hold and in which order requests get in."""

    # The most requests running at once.
    max_num_seqs: int = 256
    # The most tokens one step computes.
    max_num_batched_tokens: int = 8192
    # Long prompts are computed in chunks across steps, beside other requests' decodes.
    enable_chunked_prefill: bool = True
    # The waiting queue's order (``conveyor.engine.core.waiting_queues``): fcfs, priority, prefix, srpf or edf.
    scheduling_policy: str = "fcfs"
    # Whether a waiting request may start (``conveyor.engine.core.admission``): ``watermark`` keeps a small
    # share of blocks free; ``predicted`` also requires the predicted KV need of everything
    # running, from the output lengths of finished requests, to fit.
    admission_policy: str = "watermark"
    # An inter-token latency target: the prefill tokens per step adapt to keep the p90 of
    # the steps that carry decodes under it (``conveyor.engine.core.chunk_budget``). None: no target, every
    # step may fill max_num_batched_tokens with prefill.
    target_itl_ms: float | None = None

    def __post_init__(self) -> None:
        _check_positive_int(self.max_num_seqs, "max_num_seqs")
        _check_positive_int(self.max_num_batched_tokens, "max_num_batched_tokens")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy must be one of {ADMISSION_POLICIES}, got {self.admission_policy!r}")
        if self.target_itl_ms is not None and (
            isinstance(self.target_itl_ms, bool)
            or not isinstance(self.target_itl_ms, (int, float))
            or not math.isfinite(self.target_itl_ms)
            or self.target_itl_ms <= 0
        ):
            raise ValueError(
                f"target_itl_ms must be a positive number of milliseconds or None, got {self.target_itl_ms!r}"
            )


@dataclass
class ParallelConfig:
    """How many processes and threads run the model."""

    # Tensor parallelism: this many processes (one GPU each on CUDA) each hold a slice of
    # every layer and of the KV cache (``conveyor.engine.distributed``).
    tensor_parallel_size: int = 1
    # torch's intra-op threads (``conveyor.engine.runner.cpu_threads``). None: the CPUs this process may use
    # (affinity, cgroup quota; OMP_NUM_THREADS when set), and on CPU the engine tunes the count
    # under that ceiling from its own step times (``conveyor.engine.runner.thread_tuner``); a number: exactly
    # that many, never tuned.
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        check_cpu_threads(self.cpu_threads)


def _check_budget(value: object, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")


@dataclass
class InputConfig:
    """Budgets of the work done on each request's inputs before it runs
    (``conveyor.engine.inputs``): past one, that request alone is refused."""

    # The most seconds a request's grammar (structured outputs) may take to compile; past it
    # the request fails ``grammar_too_complex``. None: no limit, and compiled in-process.
    grammar_compile_seconds: float | None = 10.0
    # The most seconds tokenising a request's prompt may take; past it the request fails
    # ``prompt_too_long``. None: no limit.
    tokenize_seconds: float | None = 10.0

    def __post_init__(self) -> None:
        _check_budget(self.grammar_compile_seconds, "grammar_compile_seconds")
        _check_budget(self.tokenize_seconds, "tokenize_seconds")


# The groups of ``EngineConfig`` and the flat keyword arguments (``LLM(...)``'s) each takes.
GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "inputs": InputConfig,
}
_FLAT: dict[str, str] = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}
# Speculative decoding's flat name; its group is ``EngineConfig.speculative``.
SPECULATIVE_FLAT = "speculative_config"


class EngineConfig:
    """The engine's configuration in groups: ``model`` (``ModelConfig``), ``cache``
    (``CacheConfig``), ``scheduler`` (``SchedulerConfig``), ``parallel`` (``ParallelConfig``),
    ``inputs`` (``InputConfig``) and ``speculative`` (``SpeculativeConfig`` or None: off), each validated up front.

    Built from the groups, ``EngineConfig(ModelConfig("m"), cache=CacheConfig(block_size=8))``,
    or from flat keyword arguments naming their fields, ``EngineConfig("m", block_size=8,
    speculative_config={"method": "ngram"})``: what ``LLM(...)`` and ``CONVEYOR_ENGINE_ARGS``
    pass. A flat name also reads its field (``config.block_size``)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    inputs: InputConfig
    speculative: SpeculativeConfig | None

    def __init__(
        self,
        model: ModelConfig | str | os.PathLike[str],
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        parallel: ParallelConfig | None = None,
        inputs: InputConfig | None = None,
        speculative: SpeculativeConfig | dict[str, Any] | None = None,
        **flat: Any,
    ) -> None:
        given: dict[str, Any] = {"cache": cache, "scheduler": scheduler, "parallel": parallel, "inputs": inputs}
        if isinstance(model, ModelConfig):
            given["model"] = model
        else:
            flat["model"] = model
        unknown = sorted(set(flat) - set(_FLAT) - {SPECULATIVE_FLAT})
        if unknown:
            raise TypeError(f"EngineConfig got unknown field(s) {unknown}; known: {sorted(self.flat_field_names())}")
        if SPECULATIVE_FLAT in flat:
            if speculative is not None:
                raise ValueError("speculative_config and speculative are the same setting; give one")
            speculative = flat.pop(SPECULATIVE_FLAT)
        for group, cls in GROUPS.items():
            mine = {k: v for k, v in flat.items() if _FLAT[k] == group}
            if given.get(group) is not None and mine:
                raise ValueError(f"{sorted(mine)} belong to the {group} group, which was given whole; give one")
            setattr(self, group, given.get(group) or cls(**mine))
        self.speculative = SpeculativeConfig.from_value(speculative) if speculative is not None else None
        self._check_across_groups()

    @staticmethod
    def flat_field_names() -> set[str]:
        """Every flat keyword argument, ``model`` and ``speculative_config`` included."""
        return {*_FLAT, SPECULATIVE_FLAT}

    def as_flat(self) -> dict[str, Any]:
        """Every field by its flat name, as plain values (JSON's, once ``model`` is a string):
        ``EngineConfig(**config.as_flat())`` is ``config``."""
        out = {name: getattr(getattr(self, group), name) for name, group in _FLAT.items()}
        out[SPECULATIVE_FLAT] = dataclasses.asdict(self.speculative) if self.speculative is not None else None
        return out

    def replace(self, **flat: Any) -> EngineConfig:
        """A copy with the fields named (flat names) changed, validated again."""
        return EngineConfig(**{**self.as_flat(), **flat})

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found otherwise: a flat field reads its group's.
        group = _FLAT.get(name)
        if group is not None and group in self.__dict__:
            return getattr(self.__dict__[group], name)
        if name == SPECULATIVE_FLAT and "speculative" in self.__dict__:
            return self.speculative
        raise AttributeError(f"EngineConfig has no field {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and vars(self) == vars(other)

    def __repr__(self) -> str:
        groups = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"EngineConfig({groups})"

    def _check_across_groups(self) -> None:
        size = self.parallel.tensor_parallel_size
        if size > 1 and self.resolve_device().type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs, but {torch.cuda.device_count()} are visible"
            )
        sched, max_len = self.scheduler, self.model.max_model_len
        if not sched.enable_chunked_prefill and max_len and sched.max_num_batched_tokens < max_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({sched.max_num_batched_tokens} < {max_len})"
            )

    def max_model_len_for(self, model_spec: ModelSpec, model_impl: str) -> int:
        """The longest sequence this engine takes: ``max_model_len`` when set (checked against
        the model's limit), else the model's limit (under the transformers fallback, which
        attends to the full context, no more than its sliding window)."""
        limit = model_spec.max_position_embeddings
        if model_spec.sliding_window and model_impl == "transformers":
            limit = min(limit, model_spec.sliding_window)
        wanted = self.model.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            window = " (its sliding window)" if limit == model_spec.sliding_window else ""
            raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {limit}{window}")
        return wanted

    @property
    def logit_rows_per_seq(self) -> int:
        """The most rows of one sequence whose logits a step keeps: 1, or with speculative
        decoding its decode and every proposal (all verified at once)."""
        return 1 + self.num_speculative_tokens

    @property
    def num_speculative_tokens(self) -> int:
        """The most proposals one sequence verifies in a step (0: speculative decoding off)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    def resolve_device(self) -> torch.device:
        if self.model.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.model.device)

    def resolve_dtype(self, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
        if self.model.dtype != "auto":
            return DTYPES[self.model.dtype]
        if device.type == "cpu":
            return torch.float32  # half-precision matmuls are slow or missing on most CPUs
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensors' dtype: the model's, or e4m3 for ``"fp8"``."""
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else model_dtype


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_kv_bytes(config: EngineConfig, device: torch.device, activation_bytes: int) -> int:
    """The most memory the KV cache may take once the weights are loaded.

    On CUDA: ``gpu_memory_utilization`` of the device, less what is already used (weights,
    the CUDA context, other processes) and less a reserve for one step's activations.
    On CPU: a share of available RAM, capped.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return int(total * config.cache.gpu_memory_utilization) - used - activation_bytes
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 4 << 30
    return min(int(avail * CPU_KV_CACHE_RAM_FRACTION), CPU_KV_CACHE_MAX_BYTES)


def cpu_default_kv_bytes(config: EngineConfig, weight_bytes: int, token_bytes: int, max_model_len: int) -> int:
    """The KV cache's size on CPU when nobody set one: as many bytes as the weights.

    A CPU decode step is bound by the bytes it reads, weights plus the KV of every running
    sequence; a cache as large as the weights at most doubles that, and more concurrency
    than it holds buys little throughput on a CPU while costing memory. It still holds at
    least one sequence of ``max_model_len`` tokens (any request fits), and no more than
    ``max_num_seqs`` sequences of ``CPU_KV_TOKENS_PER_SEQ`` tokens could use.
    """
    one_full_sequence = max_model_len * token_bytes
    useful = config.scheduler.max_num_seqs * min(max_model_len, CPU_KV_TOKENS_PER_SEQ) * token_bytes
    return max(one_full_sequence, min(weight_bytes, useful))
