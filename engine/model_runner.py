"""Owns the weights and the KV tensors; turns a scheduled batch into flat tensors and runs it.

The batch is flat and unpadded: the tokens of all scheduled requests back to back, requests
with a single query token (decodes) first, then prefill chunks. On CUDA, a batch of decodes
only replays a captured CUDA graph instead (``engine.cuda_graphs``; off with ``enforce_eager``).

Under tensor parallelism rank 0's runner starts the other ranks (``engine.distributed``),
sends each step's flat batch to them and samples; theirs run the same forward pass
(``run_step``). CUDA graphs are off then.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import create_backend
from engine.attention.triton_backend import TritonAttention
from engine.config import EngineConfig, available_kv_bytes, cpu_default_kv_bytes, kv_block_bytes
from engine.cuda_graphs import DecodeGraphs
from engine.distributed import parallel_state
from engine.distributed.rank_args import RankArgs
from engine.distributed.rank_group import RankGroup
from engine.distributed.sharding import check_tensor_parallel, local_kv_heads
from engine.distributed.step_inputs import StepInputs
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model
from engine.models.model_config import ModelSpec
from engine.prompt_logprobs import PromptEntries, PromptLogprobRows
from engine.prompt_logprobs import compute as compute_prompt_logprobs
from engine.prompt_logprobs import rows_for as prompt_logprob_rows
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig
from engine.startup import StartupTimings, sync
from kernels.utils import cdiv

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: list[Request]  # requests that produced a token this step, in batch order
    output: SamplerOutput | None
    # Speculative decoding: the requests whose proposals were computed this step, and the
    # target's logits at each of their 1 + k positions, request after request.
    verified: list[Request] = field(default_factory=list)
    verify_logits: torch.Tensor | None = None
    # The prompt logprobs this step computed, per request that asked for them.
    prompt_logprobs: list[tuple[Request, PromptEntries]] = field(default_factory=list)


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
        extra_block_bytes: int = 0,
    ) -> None:
        # Each phase's seconds are added to ``startup`` (the engine's, when it builds us).
        self.startup = startup = startup if startup is not None else StartupTimings(started_at=time.time())
        self.config = config
        self.max_model_len = max_model_len
        self.spec = spec
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(spec.checkpoint_dtype, self.device)
        self.block_size = config.block_size
        # Bytes another cache indexed by the same block ids takes per block (a draft model's).
        self.extra_block_bytes = extra_block_bytes
        begin = time.perf_counter()
        self.model_impl = model_impl  # native or transformers (``engine.models.transformers_fallback``)
        # Rank 0 of a tensor-parallel engine starts the other ranks, which build runners too.
        # The layers read this process's one parallel state: one such engine per process.
        state = parallel_state.current()
        if state.enabled and state.rank == 0:
            raise RuntimeError("a tensor-parallel engine is already running in this process; shut it down first")
        leader = config.tensor_parallel_size > 1 and not state.enabled  # (not one of the ranks it starts)
        self.ranks = self._start_ranks(model_path, model_impl) if leader else None
        self.tp = parallel_state.current()
        assert self.tp.world_size == config.tensor_parallel_size
        if self.tp.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.tp.rank)
        if self.ranks is not None:
            # Stop the ranks when this runner goes (or the process exits), whatever the path.
            weakref.finalize(self, self.ranks.close)
        self.model = load_model(model_path, spec, max_model_len, self.dtype, self.device, model_impl)
        sync(self.device)
        startup.weights += time.perf_counter() - begin
        self.backend = create_backend(config.attention_backend, self.device)
        self.sampler = Sampler(self.device, config.seed)
        begin = time.perf_counter()
        self.num_kv_heads = local_kv_heads(spec.num_kv_heads, self.tp.world_size)  # this rank's
        self.num_blocks = self._agreed_num_blocks()
        shape = (spec.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, spec.head_dim)
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

    def _agreed_num_blocks(self) -> int:
        """The KV blocks this rank can hold; under tensor parallelism, the fewest any rank can
        (every rank caches the same blocks, its own KV heads of them)."""
        mine = self._num_kv_blocks()
        try:
            return self.tp.min_int(mine, self.device)
        except Exception as exc:  # a rank failed to load: say which, not the collective's error
            if self.ranks is None:
                raise
            raise self.ranks.error(exc) from exc

    def _start_ranks(self, model_path: Path, model_impl: str) -> RankGroup:
        size = self.config.tensor_parallel_size
        if model_impl != "native":
            raise ValueError("tensor parallelism needs a native model, not the transformers fallback")
        check_tensor_parallel(self.spec, size)
        threads = max(1, torch.get_num_threads() // size)
        if self.device.type == "cpu":  # the ranks share the cores: more threads each only spin
            log.info("tensor parallelism on CPU: %d torch threads per rank, this process's included", threads)
            torch.set_num_threads(threads)
        args = RankArgs(
            rank=0,
            world_size=size,
            port=0,
            backend="nccl" if self.device.type == "cuda" else "gloo",
            config=self.config,
            spec=self.spec,
            model_path=model_path,
            max_model_len=self.max_model_len,
            model_impl=model_impl,
            cpu_threads=threads,
        )
        return RankGroup.start(args, self.device, ModelRunner)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        if self.ranks is not None:
            self.ranks.close()

    def _num_kv_blocks(self) -> int:
        config, spec = self.config, self.spec
        if config.num_kv_blocks is not None:
            self.kv_budget_source = "num_kv_blocks"
            return config.num_kv_blocks
        per_block = kv_block_bytes(spec.num_layers, self.block_size, self.num_kv_heads, spec.head_dim, self.dtype)
        per_block += self.extra_block_bytes
        elem = torch.empty((), dtype=self.dtype).element_size()
        # One step's activations, generously: hidden states, fused projections and logits.
        tokens = config.max_num_batched_tokens
        activation = tokens * (4 * spec.hidden_size + 3 * spec.intermediate_size) * elem * 2
        logit_rows = config.max_num_seqs
        if config.speculative_config is not None:  # verification keeps 1 + k rows per request
            k = SpeculativeConfig.from_value(config.speculative_config).num_speculative_tokens
            logit_rows = min(config.max_num_batched_tokens, logit_rows * (1 + k))
        activation += logit_rows * spec.vocab_size * 4 * 3
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
        if self.tp.enabled:
            log.info("CUDA graphs are off under tensor parallelism; decode runs eagerly")
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
        verify_rows: list[int] = []
        verified: list[Request] = []
        prompt_plans: list[PromptLogprobRows] = []
        end = 0
        for req, n, table in zip(reqs, counts, tables, strict=True):
            start = req.num_computed_tokens
            if req.prompt_logprobs is not None and (plan := prompt_logprob_rows(req, start, n, end)) is not None:
                prompt_plans.append(plan)
            spec = len(req.spec_token_ids)
            if n == 1:  # a decode: plain ints beat numpy for one token
                input_ids.append(req.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                tokens = req.token_ids + req.spec_token_ids if spec else req.token_ids
                input_ids.extend(tokens[start : start + n])
                pos = np.arange(start, start + n, dtype=np.int64)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            seq_lens.append(start + n)
            end += n
            if spec and start + n == req.num_tokens + spec:  # a decode with proposals to verify
                verify_rows.extend(range(end - 1 - spec, end))
                verified.append(req)
            elif start + n == req.num_tokens:
                sample_rows.append(end - 1)
                sampled.append(req)

        if self.ranks is not None:
            prompt_rows = [r for plan in prompt_plans for r in plan.rows]
            wanted = sorted(verify_rows + sample_rows + prompt_rows)  # in the batch's order, as run_step takes them
            inputs = StepInputs(input_ids, positions, slots, seq_lens, counts, tables, num_decodes, wanted)
            return self._execute_parallel(inputs, sampled, sample_rows, verified, verify_rows, prompt_plans)
        max_blocks = max(len(t) for t in tables)
        graphs, bucket = self.graphs, None
        if graphs is not None and num_decodes == len(reqs):
            bucket = graphs.bucket_for(len(reqs), max_blocks)
        if graphs is not None and bucket is not None:
            hidden = graphs.run(bucket, input_ids, positions, slots, seq_lens, tables, max_blocks)
        else:
            hidden = self._forward_eager(input_ids, positions, slots, seq_lens, counts, tables, num_decodes)
        result = StepResult([], None)
        if prompt_plans:
            dev = self.device
            result.prompt_logprobs = compute_prompt_logprobs(
                prompt_plans, lambda rows: self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
            )
        if verified:
            rows = hidden[torch.tensor(verify_rows, device=self.device)]
            result.verified, result.verify_logits = verified, self.model.compute_logits(rows)
        if not sampled:
            return result
        # Every row is sampled (always so for decodes), or only the last of each request.
        rows = hidden if len(sample_rows) == len(input_ids) else hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(rows)
        result.sampled, result.output = sampled, self.sampler(logits, sampled)
        return result

    def _execute_parallel(
        self,
        inputs: StepInputs,
        sampled: list[Request],
        sample_rows: list[int],
        verified: list[Request],
        verify_rows: list[int],
        prompt_plans: list[PromptLogprobRows],
    ) -> StepResult:
        """Rank 0's step under tensor parallelism: the inputs to every rank, the forward pass
        everywhere, the logits of the rows to sample and to verify gathered here."""
        assert self.ranks is not None
        try:
            self.ranks.send_step(inputs)
            logits = self.run_step(inputs)
        except Exception as exc:  # a collective failed: say which rank died, if one did
            raise self.ranks.error(exc) from exc
        result = StepResult([], None)
        if logits is None:
            return result
        index = {row: i for i, row in enumerate(inputs.sample_rows)}
        if prompt_plans:
            result.prompt_logprobs = compute_prompt_logprobs(
                prompt_plans, lambda rows: logits[torch.tensor([index[r] for r in rows], device=logits.device)]
            )
        if verified:
            picked = torch.tensor([index[r] for r in verify_rows], device=logits.device)
            result.verified, result.verify_logits = verified, logits[picked]
        if sampled:
            picked = torch.tensor([index[r] for r in sample_rows], device=logits.device)
            result.sampled, result.output = sampled, self.sampler(logits[picked], sampled)
        return result

    def run_step(self, inputs: StepInputs) -> torch.Tensor | None:
        """One step's forward pass on any rank; the sampled rows' logits (rank 0's: the whole
        vocabulary; the other ranks': nothing useful), or None when no row is sampled."""
        hidden = self._forward_eager(
            inputs.input_ids,
            inputs.positions,
            inputs.slots,
            inputs.seq_lens,
            inputs.query_lens,
            inputs.tables,
            inputs.num_decodes,
        )
        if not inputs.sample_rows:
            return None
        rows = inputs.sample_rows
        rows_t = hidden if len(rows) == len(inputs.input_ids) else hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(rows_t)

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
