"""Owns the weights and the KV tensors; turns a scheduled batch into flat tensors and runs it.

The batch is flat and unpadded: the tokens of all scheduled requests back to back, requests
with a single query token (decodes) first, then prefill chunks. On CUDA, a batch of decodes
only replays a captured CUDA graph instead (``engine.cuda_graphs``; off with ``enforce_eager``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import create_backend
from engine.attention.triton_backend import TritonAttention
from engine.config import EngineConfig, available_kv_bytes, cpu_default_kv_bytes, kv_block_bytes
from engine.cuda_graphs import DecodeGraphs
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.models.model_config import ModelSpec
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput
from engine.startup import StartupTimings, sync
from kernels.utils import cdiv

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: list[Request]  # requests that produced a token this step, in batch order
    output: SamplerOutput | None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        model_path: Path,
        max_model_len: int,
        *,
        startup: StartupTimings | None = None,
        model_impl: str = "native",
    ) -> None:
        # Each phase's seconds are added to ``startup`` (the engine's, when it builds us).
        self.startup = startup = startup if startup is not None else StartupTimings(started_at=time.time())
        self.config = config
        self.max_model_len = max_model_len
        self.spec = spec
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(spec.checkpoint_dtype, self.device)
        self.block_size = config.block_size
        begin = time.perf_counter()
        self.model_impl = model_impl  # native or transformers (``engine.models.transformers_fallback``)
        self.model = load_model(model_path, spec, max_model_len, self.dtype, self.device, model_impl)
        sync(self.device)
        startup.weights += time.perf_counter() - begin
        self.backend = create_backend(config.attention_backend, self.device)
        self.sampler = Sampler(self.device, config.seed)
        begin = time.perf_counter()
        self.num_blocks = self._num_kv_blocks()
        shape = (spec.num_layers, 2, self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(spec.num_layers)]
        sync(self.device)
        startup.kv_cache += time.perf_counter() - begin
        log.info(
            "model on %s (%s), attention=%s; KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB (%s)",
            self.device,
            self.dtype,
            self.backend.name,
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.kv_budget_source,
        )
        self.graphs: DecodeGraphs | None = None
        if self._use_cuda_graphs():
            begin = time.perf_counter()
            self.capture_decode_graphs()
            sync(self.device)
            startup.cuda_graphs = time.perf_counter() - begin

    def _num_kv_blocks(self) -> int:
        config, spec = self.config, self.spec
        if config.num_kv_blocks is not None:
            self.kv_budget_source = "num_kv_blocks"
            return config.num_kv_blocks
        per_block = kv_block_bytes(spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim, self.dtype)
        elem = torch.empty((), dtype=self.dtype).element_size()
        # One step's activations, generously: hidden states, fused projections and logits.
        tokens = config.max_num_batched_tokens
        activation = tokens * (4 * spec.hidden_size + 3 * spec.intermediate_size) * elem * 2
        activation += config.max_num_seqs * spec.vocab_size * 4 * 3
        limit = available_kv_bytes(config, self.device, activation)
        if config.kv_cache_memory_bytes is not None:
            budget, self.kv_budget_source = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif self.device.type == "cpu":
            weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
            budget = min(limit, cpu_default_kv_bytes(config, weights, per_block // self.block_size, self.max_model_len))
            self.kv_budget_source = "CPU default: the weights' size, set kv_cache_memory_bytes to change"
        else:
            budget, self.kv_budget_source = limit, f"gpu_memory_utilization={config.gpu_memory_utilization}"
        # More blocks than every sequence at full length could use is memory nobody needs.
        useful = config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB, one block is "
                f"{per_block} bytes); raise kv_cache_memory_bytes or gpu_memory_utilization, or lower "
                "max_num_batched_tokens"
            )
        return int(num_blocks)

    # ---------------------------------------------------------------------------------
    def capture_decode_graphs(self, graph_factory=None) -> None:
        """Capture the decode batches as CUDA graphs (``graph_factory``: tests replace the
        CUDA graph with one that replays by calling, to run this path on CPU)."""
        if not isinstance(self.backend, TritonAttention):
            raise ValueError("CUDA graphs need the triton attention backend")
        if not isinstance(self.model, LlamaForCausalLM):
            raise ValueError("CUDA graphs are for native models, not the transformers fallback")
        max_batch = min(self.config.max_num_seqs, self.config.cuda_graph_max_batch_size)
        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_caches,
            max_batch_size=max_batch,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            hidden_size=self.spec.hidden_size,
            dtype=self.dtype,
            device=self.device,
            graph_factory=graph_factory,
        )
        self.graphs.capture()

    def _use_cuda_graphs(self) -> bool:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        if self.model_impl != "native":
            log.info("CUDA graphs are for native models; the transformers fallback runs eagerly")
            return False
        if not isinstance(self.backend, TritonAttention):
            log.info("CUDA graphs need the triton attention backend; decode runs eagerly")
            return False
        if not self.model.supports_cuda_graphs:
            log.info("%s cannot be captured as a CUDA graph; decode runs eagerly", self.spec.architecture)
            return False
        return True

    def execute(self, sched: SchedulerOutput, block_ids_of) -> StepResult:
        # Decodes first, by context length (the torch backend buckets them by it), then prefills.
        order = sorted(
            range(len(sched.requests)),
            key=lambda i: (sched.num_new_tokens[i] != 1, sched.requests[i].num_computed_tokens),
        )
        reqs = [sched.requests[i] for i in order]
        counts = [sched.num_new_tokens[i] for i in order]
        bs = self.block_size
        num_decodes = sum(1 for n in counts if n == 1)

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables = [block_ids_of(r) for r in reqs]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        end = 0
        for req, n, table in zip(reqs, counts, tables, strict=True):
            start = req.num_computed_tokens
            if n == 1:  # a decode: plain ints beat numpy for one token
                input_ids.append(req.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(req.token_ids[start : start + n])
                pos = np.arange(start, start + n, dtype=np.int64)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            seq_lens.append(start + n)
            end += n
            if start + n == req.num_tokens:
                sample_rows.append(end - 1)
                sampled.append(req)

        max_blocks = max(len(t) for t in tables)
        graphs, bucket = self.graphs, None
        if graphs is not None and num_decodes == len(reqs):
            bucket = graphs.bucket_for(len(reqs), max_blocks)
        if graphs is not None and bucket is not None:
            hidden = graphs.run(bucket, input_ids, positions, slots, seq_lens, tables, max_blocks)
        else:
            hidden = self._forward_eager(input_ids, positions, slots, seq_lens, counts, tables, num_decodes)
        if not sampled:
            return StepResult([], None)
        # Every row is sampled (always so for decodes), or only the last of each request.
        rows = hidden if len(sample_rows) == len(input_ids) else hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(rows)
        return StepResult(sampled, self.sampler(logits, sampled))

    def _forward_eager(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        counts: list[int],
        tables: list[list[int]],
        num_decodes: int,
    ) -> torch.Tensor:
        dev = self.device
        self.backend.prepare(AttentionMetadata.from_host(slots, tables, counts, seq_lens, num_decodes, dev))
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        return self.model(ids, pos_t, self.backend, self.kv_caches)
