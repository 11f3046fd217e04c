"""The engine loop: requests in, one scheduled step at a time, ``RequestOutput`` deltas out."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from conveyor.engine.attention.triton_backend import prepare_interpreter
from conveyor.engine.config import EngineConfig
from conveyor.engine.core.chunk_budget import make_chunk_controller
from conveyor.engine.core.detokenizer import IncrementalDetokenizer
from conveyor.engine.core.output_processor import OutputProcessor
from conveyor.engine.core.request import Request, RequestStatus
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.startup import StartupTimings, sync
from conveyor.engine.inputs.processor import InputProcessor, PreparedInput, Prompt
from conveyor.engine.inputs.request_fields import check_request_fields
from conveyor.engine.memory.kv_cache import window_release
from conveyor.engine.memory.state_memory import make_request_memory
from conveyor.engine.models.bert import encoder_engine_config
from conveyor.engine.models.loader import load_spec, load_tokenizer, resolve_model_path
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.pooling.pooler import embedding_support
from conveyor.engine.pooling.scoring import score_head
from conveyor.engine.runner.cpu_threads import apply_cpu_budget, cpu_budget
from conveyor.engine.runner.model_runner import ModelRunner
from conveyor.engine.runner.thread_tuner import ThreadTuner
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.spec_decode.speculator import load_speculator
from conveyor.engine.spec_decode.stats import SpecDecodeStats
from conveyor.engine.structured.structured_outputs import StructuredOutputManager
from conveyor.engine.structured.thinking import gate_for

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float
    kv_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_evictions: int
    num_steps: int
    last_step_tokens: int
    avg_tokens_per_step: float
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on
    cpu_threads: int = 0  # torch's intra-op threads the last step ran on


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # How long each phase of this start took (``conveyor.engine.core.startup``): a worker reports it.
        self.startup = startup = StartupTimings(started_at=time.time())
        begin = time.perf_counter()
        self.config = config
        # Before anything runs torch operators (loading the weights included); the ranks of
        # tensor parallelism split this count between them (``ModelRunner``).
        self.cpu_budget = cpu_budget(config.parallel.cpu_threads)
        apply_cpu_budget(self.cpu_budget)
        log.info("engine: %s", self.cpu_budget.describe())
        if config.model.attention_backend == "triton":
            # Triton chooses its CPU interpreter when first imported, and transformers imports
            # it while the tokenizer loads below: off CUDA, choose now or the kernels cannot run.
            prepare_interpreter(config.resolve_device())
        model_path = resolve_model_path(config.model.model, config.model.revision)
        self.model_spec, self.model_impl = load_spec(model_path, config.model.model_impl, config.model.quantization)
        # An encoder runs each input whole, with no KV cache (``conveyor.engine.models.bert``).
        self.config = config = encoder_engine_config(config, self.model_spec)
        tok_path = (
            resolve_model_path(config.model.tokenizer, config.model.revision) if config.model.tokenizer else model_path
        )
        tok_begin = time.perf_counter()
        self.tokenizer = load_tokenizer(tok_path)
        startup.tokenizer = time.perf_counter() - tok_begin
        max_len = config.max_model_len_for(self.model_spec, self.model_impl)
        # Before the target's KV cache is sized: a draft model's cache takes a share of it.
        self.speculator = load_speculator(config, self.model_spec, self.tokenizer, max_len)
        startup.weights += time.perf_counter() - begin  # the runner adds the weights themselves
        self.runner = ModelRunner(
            config,
            self.model_spec,
            model_path,
            max_len,
            startup=startup,
            model_impl=self.model_impl,
            extra_block_bytes=self.speculator.block_bytes(config.cache.block_size),
        )
        self.speculator.attach(self.runner)
        kv_begin = time.perf_counter()
        released_beyond, margin = window_release(self.model_spec, self.model_impl, self.speculator.draft)
        self.kv = make_request_memory(
            self.runner.state_cache,
            speculative=config.speculative is not None,
            num_blocks=self.runner.num_blocks,
            block_size=config.cache.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            namespace=f"{model_path.resolve() if model_path.exists() else model_path}|{self.runner.dtype}",
            release_window=released_beyond,
            window_margin=margin,
        )
        startup.kv_cache += time.perf_counter() - kv_begin
        self.max_model_len = max_len
        # A request never grows past what the whole cache can hold, so it always fits alone;
        # without chunked prefill it must also fit one step's budget, or (re)admitting it never
        # could happen.
        self.max_request_tokens = min(max_len, self.runner.num_blocks * config.cache.block_size)
        if not config.scheduler.enable_chunked_prefill:
            self.max_request_tokens = min(self.max_request_tokens, config.scheduler.max_num_batched_tokens)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
            policy=config.scheduler.scheduling_policy,
            admission=config.scheduler.admission_policy,
            chunk_controller=make_chunk_controller(
                config.scheduler.target_itl_ms, config.cache.block_size, config.scheduler.max_num_batched_tokens
            ),
        )
        eos = set(self.model_spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = self.model_spec.vocab_size
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids, compile_budget_s=config.inputs.grammar_compile_seconds
        )
        self.runner.sampler.structured = self.structured
        score = score_head(model_path, self.model_spec, self.runner.model, self.tokenizer)
        self.embedding = embedding_support(model_path, self.model_spec, config, score)
        chunked = config.scheduler.enable_chunked_prefill
        no_chunks = "" if chunked else ", max_num_batched_tokens without chunked prefill"
        self.inputs = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_request_tokens,
            f"max_model_len {max_len}, KV cache {self.runner.num_blocks * self.kv.block_size} tokens{no_chunks}",
            self.structured,
            self.embedding,
            tokenize_seconds=config.inputs.tokenize_seconds,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._groups: dict[str, list[Request]] = {}
        self._seq = itertools.count()
        self._pending: list[RequestOutput] = []
        # The steps' intra-op threads: the budget (this rank's share of it under tensor
        # parallelism), or on CPU what the tuner picks under it.
        self._base_threads = self._step_threads = torch.get_num_threads()
        budget = self.cpu_budget
        tunable = self.runner.device.type == "cpu" and config.parallel.tensor_parallel_size == 1 and budget.derived
        self.thread_tuner = ThreadTuner(budget.threads) if tunable and budget.threads > 1 else None
        sync(self.runner.device)
        startup.total = time.perf_counter() - begin

    # ---- requests in ----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Prompt | PreparedInput,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        deadline: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError`` naming what is wrong with bad input.
        ``prompt`` may be a ``PreparedInput`` (``prepare_input``'s, done on another thread):
        then nothing per request is left to do here but make its sequences.

        ``priority`` (lower first) orders the queue under the ``priority`` policy; ``deadline``
        (wall-clock epoch seconds, ``time.time()``'s clock) under ``edf``, and breaks ties
        between equal priorities under ``priority``. Other policies ignore both."""
        deadline = check_request_fields(request_id, priority, deadline)
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prepared = self.inputs.resolve(prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self._sequences(request_id, prepared, priority, deadline, arrival)
        self._groups[request_id] = children
        for child in children:
            self.scheduler.add_request(child)

    def _sequences(
        self, request_id: str, prepared: PreparedInput, priority: int, deadline: float | None, arrival: float
    ) -> list[Request]:
        """The request's ``n`` sequences, each its own ``Request`` with its own seed."""
        params, ids, text, pooling = prepared.params, prepared.token_ids, prepared.text, prepared.pooling
        compiled = prepared.grammar
        children = []
        for index in range(params.n):
            seq = next(self._seq)
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed(params.seed + index)
            children.append(
                Request(
                    f"{seq}",
                    ids,
                    params,
                    max_total_tokens=self.max_request_tokens,
                    eos_token_ids=self.eos_token_ids,
                    arrival_seq=seq,
                    request_id=request_id,
                    index=index,
                    priority=priority,
                    deadline=deadline,
                    arrival_time=arrival,
                    generator=generator,
                    # Without streaming or stop strings the text is decoded once, at the end.
                    detokenizer=(
                        IncrementalDetokenizer(
                            self.tokenizer, params.stop_strings, params.skip_special_tokens, params.min_tokens
                        )
                        if params.stream or params.stop_strings
                        else None
                    ),
                    prompt_text=text,
                    grammar=gate_for(
                        params, ids, compiled.matcher() if compiled is not None else None, self.inputs.encode_delimiter
                    ),
                    pooling=pooling,
                )
            )
        return children

    def prepare_input(self, prompt: Prompt, params: SamplingParams | None = None) -> PreparedInput:
        """``prompt`` tokenised (its chat template applied) and its grammar compiled, for
        ``add_request``: thread-safe, so an input stage may run it beside the loop.
        ``ValueError`` (``InputRejected`` with its code) naming what is wrong."""
        return self.inputs.resolve(prompt, params)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for req in self._groups.pop(rid, ()):
                if not req.finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                    req.metrics.finished_time = time.monotonic()
                    self._pending.append(self.outputs.output(req, [], ""))

    @property
    def release_window(self) -> int | None:
        """The sliding window past which blocks are released as requests run (None: never)."""
        return self.kv.release_window

    @release_window.setter
    def release_window(self, window: int | None) -> None:
        self.kv.release_window = window

    # ---- the loop ---------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update, outputs: one iteration of continuous batching."""
        outputs, self._pending = self._pending, []
        begin = time.perf_counter()
        self.speculator.plan(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.requests:
            return outputs
        step_begin = self._set_step_threads()
        self.speculator.propose(sched, self.scheduler.running)
        result = self.runner.execute(sched)
        self._step_done(step_begin, sched.total_tokens)
        result.duration_s = time.perf_counter() - begin
        finished = self.scheduler.update_from_output(sched, result)
        ended = set(finished)
        outputs += [self.outputs.emit(req) for req in result.requests if req in ended or req.params.stream]
        for req in finished:
            self._forget(req)
        return outputs

    def _set_step_threads(self) -> float:
        """The step's intra-op threads (the tuner's pick, on CPU); when the step starts."""
        tuner = self.thread_tuner
        self._step_threads = tuner.before_step() if tuner is not None else self._base_threads
        if torch.get_num_threads() != self._step_threads:  # torch keeps it per thread: the stepping one's
            torch.set_num_threads(self._step_threads)
        return time.perf_counter()

    def _step_done(self, step_begin: float, num_tokens: int) -> None:
        if self.thread_tuner is not None:
            self.thread_tuner.after_step(time.perf_counter() - step_begin, num_tokens)

    def _forget(self, req: Request) -> None:
        group = self._groups.get(req.request_id)
        if group is not None and all(r.finished for r in group):
            del self._groups[req.request_id]

    def shutdown(self) -> None:
        """Stop the processes this engine started (tensor-parallel ranks); it runs no step after.
        Also done when the engine is garbage-collected or the process exits."""
        self.runner.shutdown()
        self.structured.close()

    # ---- observability ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv, counters = self.kv, self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_usage=kv.usage,
            kv_blocks_cached=kv.num_cached_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            prefix_cache_hit_rate=kv.stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=kv.pool.num_evictions,
            num_steps=counters.num_steps,
            last_step_tokens=counters.last_step_tokens,
            avg_tokens_per_step=counters.total_step_tokens / counters.num_steps if counters.num_steps else 0.0,
            num_prompt_tokens_computed=counters.num_prompt_tokens_computed,
            num_generated_tokens=counters.num_generated_tokens,
            spec_decode=self.speculator.stats_snapshot(),
            cpu_threads=self._step_threads,
        )
