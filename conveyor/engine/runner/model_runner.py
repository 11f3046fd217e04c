"""Owns the weights and the KV tensors; runs each scheduled step.

A step is built into a flat, unpadded batch (``conveyor.engine.runner.batch``: the tokens of all scheduled
requests back to back, decodes first), run by this runner's executor (``conveyor.engine.runner.executors``:
eager, CUDA graphs, or rank 0 of tensor parallelism), and the rows it wants are sampled.
Add-ons that need more rows' logits (prompt logprobs, speculative decoding's verification)
are the builder's row hooks: they get those rows' logits after sampling.

Under tensor parallelism rank 0's runner starts the other ranks (``conveyor.engine.distributed``);
theirs run the same forward pass (``run_step``).
"""

from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path

import torch

from conveyor.engine.attention.base import AttentionMetadata
from conveyor.engine.attention.selector import create_backend
from conveyor.engine.attention.triton_backend import TritonAttention
from conveyor.engine.config import EngineConfig, available_kv_bytes, cpu_default_kv_bytes, kv_cache_torch_dtype
from conveyor.engine.core.scheduler_output import SchedulerOutput
from conveyor.engine.core.startup import StartupTimings, sync
from conveyor.engine.core.step_result import StepResult
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.leader import start_ranks
from conveyor.engine.distributed.step_inputs import StepInputs
from conveyor.engine.memory.state_cache import allocate_state, state_bytes_per_seq
from conveyor.engine.models.kv_layout import KVLayout
from conveyor.engine.models.layers import kernel_ops, use_kernel_ops
from conveyor.engine.models.loader import load_model
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.pooling.pooler import PoolingHook
from conveyor.engine.runner.batch import LogitsOf, RowHook, StepRows, build_batch
from conveyor.engine.runner.cuda_graphs import DecodeGraphs, graphs_apply
from conveyor.engine.runner.executors import Executor, choose_executor
from conveyor.engine.sample.prompt_logprobs import PromptLogprobsHook
from conveyor.engine.sample.sampler import Sampler
from conveyor.kernels.utils import cdiv

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_spec: ModelSpec,
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
        self.model_spec = spec = model_spec
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(spec.checkpoint_dtype, self.device)
        self.block_size = config.cache.block_size
        # Bytes another cache indexed by the same block ids takes per block (a draft model's).
        self.extra_block_bytes = extra_block_bytes
        begin = time.perf_counter()
        self.model_impl = model_impl  # native or transformers (``conveyor.engine.models.transformers_fallback``)
        # Rank 0 of a tensor-parallel engine starts the other ranks, which build runners too.
        # The layers read this process's one parallel state: one such engine per process.
        self.ranks = start_ranks(config, spec, model_path, max_model_len, model_impl, self.device, ModelRunner)
        self.tp = parallel_state.current()
        assert self.tp.world_size == config.parallel.tensor_parallel_size
        self.device = self.tp.device_for(self.device)
        # Stop the ranks when this runner goes (or the process exits), whatever the path.
        weakref.finalize(self, self.ranks.close)
        self.model = load_model(
            model_path, spec, max_model_len, self.dtype, self.device, model_impl, config.cache.kv_cache_dtype
        )
        sync(self.device)
        startup.weights += time.perf_counter() - begin
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.backend = create_backend(config.model.attention_backend, self.device)
        use_kernel_ops(self.model, kernel_ops(self.device, self.backend.name))
        self.sampler = Sampler(self.device, config.model.seed)
        begin = time.perf_counter()
        # What a block holds: this rank's K/V heads, or MLA's latent (``conveyor.engine.models.kv_layout``).
        self.kv_layout = KVLayout.for_model(spec, self.tp.world_size)
        self.num_kv_heads = self.kv_layout.heads
        # A hybrid model keeps K/V for its full-attention layers only (``ModelSpec.kv_cache_layers``),
        # and a state slot per running request (``conveyor.engine.memory.state_cache``, plus one for decode graphs'
        # padding rows; with speculative decoding, its snapshots), reserved out of the same budget.
        num_snapshots = config.num_speculative_tokens
        self.state_bytes = (config.scheduler.max_num_seqs + 1) * state_bytes_per_seq(self.model, num_snapshots)
        self.num_blocks = self._agreed_num_blocks()
        self.kv_cache, self.kv_caches = self.kv_layout.allocate(
            self.num_blocks, self.block_size, self.kv_dtype, self.device
        )
        self.state_cache = allocate_state(self.model, config.scheduler.max_num_seqs, self.num_blocks, num_snapshots)
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
        # Add-ons that want more rows than the sampled ones (``runner.batch``): prompt logprobs, pooling.
        self.row_hooks: list[RowHook] = [PromptLogprobsHook(), PoolingHook()]
        self.graphs: DecodeGraphs | None = None
        self.executor: Executor = choose_executor(self, self.ranks, None)
        if graphs_apply(self.device, config.model.enforce_eager, self._why_no_graphs()):
            begin = time.perf_counter()
            self.capture_decode_graphs()
            sync(self.device)
            startup.cuda_graphs = time.perf_counter() - begin

    def _agreed_num_blocks(self) -> int:
        """The KV blocks this rank can hold; under tensor parallelism, the fewest any rank can
        (every rank caches the same blocks, its own KV heads of them)."""
        mine = self._num_kv_blocks()
        with self.ranks.failures():  # a rank failed to load: say which, not the collective's error
            return self.tp.min_int(mine, self.device)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        self.ranks.close()

    def _num_kv_blocks(self) -> int:
        config, spec = self.config, self.model_spec
        if config.cache.num_kv_blocks is not None:
            self.kv_budget_source = "num_kv_blocks"
            return config.cache.num_kv_blocks
        per_block = self.kv_layout.block_bytes(self.block_size, self.kv_dtype)
        per_block += self.extra_block_bytes
        elem = torch.empty((), dtype=self.dtype).element_size()
        # One step's activations, generously: hidden states, fused projections and logits.
        tokens = config.scheduler.max_num_batched_tokens
        activation = tokens * (4 * spec.hidden_size + 3 * spec.intermediate_size) * elem * 2
        logit_rows = min(
            config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs * config.logit_rows_per_seq
        )
        activation += logit_rows * spec.vocab_size * 4 * 3
        limit = available_kv_bytes(config, self.device, activation + self.state_bytes)
        if config.cache.kv_cache_memory_bytes is not None:
            budget, self.kv_budget_source = config.cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif self.device.type == "cpu":
            weights = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
            budget = min(limit, cpu_default_kv_bytes(config, weights, per_block // self.block_size, self.max_model_len))
            self.kv_budget_source = "CPU default: the weights' size, set kv_cache_memory_bytes to change"
        else:
            budget, self.kv_budget_source = limit, f"gpu_memory_utilization={config.cache.gpu_memory_utilization}"
        # More blocks than every sequence at full length could use is memory nobody needs.
        useful = config.scheduler.max_num_seqs * cdiv(self.max_model_len, self.block_size)
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
        max_batch = min(self.config.scheduler.max_num_seqs, self.config.model.cuda_graph_max_batch_size)
        self.graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_caches,
            max_batch_size=max_batch,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            hidden_size=self.model_spec.hidden_size,
            dtype=self.dtype,
            device=self.device,
            graph_factory=graph_factory,
        )
        self.graphs.capture()
        self.executor = choose_executor(self, self.ranks, self.graphs)

    def _why_no_graphs(self) -> dict[str, bool]:
        return {
            "CUDA graphs are off under tensor parallelism; decode runs eagerly": self.tp.enabled,
            "CUDA graphs are for native models; the transformers fallback runs eagerly": self.model_impl != "native",
            "CUDA graphs need the triton attention backend; decode runs eagerly": not isinstance(
                self.backend, TritonAttention
            ),
            f"{self.model_spec.architecture} cannot be captured as a CUDA graph; decode runs eagerly": not getattr(
                self.model, "supports_cuda_graphs", False
            ),
        }

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Build the step's batch, run it, sample its finished rows and hand the hooks theirs."""
        batch = build_batch(sched, self.block_size, self.row_hooks)
        logits_of = self.executor.run(batch)
        result = StepResult()
        if logits_of is None:
            return result
        if batch.sampled:
            out = self.sampler(logits_of(batch.sample_rows), batch.sampled)
            result.sampled, result.sampled_token_ids, result.sampled_logprobs = (
                batch.sampled,
                out.token_ids,
                out.logprobs,
            )
        for hook, plans in zip(self.row_hooks, batch.plans, strict=True):
            if plans:
                hook.collect(plans, logits_of, result)
        return result

    def logits_of(self, hidden: torch.Tensor) -> LogitsOf:
        """``logits_of(rows)`` over this step's hidden states (which it keeps, for pooling)."""
        return StepRows(hidden, self.model.compute_logits)

    def run_step(self, inputs: StepInputs) -> torch.Tensor | None:
        """One step's forward pass on any rank; the sampled rows' logits (rank 0's: the whole
        vocabulary; the other ranks': nothing useful), or None when no row is sampled."""
        hidden = self.forward_eager(
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

    def forward_eager(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        counts: list[int],
        tables: list[list[int]],
        num_decodes: int,
    ) -> torch.Tensor:
        """The model's forward pass over a flat batch, as is (no graph): the executors' and every
        rank's (``ForwardPass``). The final hidden state of each token, in the batch's order."""
        dev = self.device
        self.backend.prepare(AttentionMetadata.from_host(slots, tables, counts, seq_lens, num_decodes, dev))
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        return self.model(ids, pos_t, self.backend, self.kv_caches)
