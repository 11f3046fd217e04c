"""The engine loop: requests in, one scheduled step at a time, ``RequestOutput`` deltas out."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.triton_backend import prepare_interpreter
from engine.chunk_budget import is_prefill, make_chunk_controller
from engine.config import EngineConfig
from engine.cpu_threads import apply_cpu_budget, cpu_budget
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.models.loader import load_spec, load_tokenizer, resolve_model_path
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft import DraftModel
from engine.spec_decode.speculator import Speculator
from engine.spec_decode.stats import SpecDecodeStats
from engine.startup import StartupTimings, sync
from engine.structured_outputs import StructuredOutputManager, check_tools
from engine.text_checks import check_text, check_texts
from engine.thread_tuner import ThreadTuner

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
MAX_CHAT_MESSAGES = 1024

Prompt = str | list[int] | dict[str, Any]


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
        # How long each phase of this start took (``engine.startup``): a worker reports it.
        self.startup = startup = StartupTimings(started_at=time.time())
        begin = time.perf_counter()
        self.config = config
        # Before anything runs torch operators (loading the weights included); the ranks of
        # tensor parallelism split this count between them (``ModelRunner``).
        self.cpu_budget = cpu_budget(config.cpu_threads)
        apply_cpu_budget(self.cpu_budget)
        log.info("engine: %s", self.cpu_budget.describe())
        if config.attention_backend == "triton":
            # Triton chooses its CPU interpreter when first imported, and transformers imports
            # it while the tokenizer loads below: off CUDA, choose now or the kernels cannot run.
            prepare_interpreter(config.resolve_device())
        model_path = resolve_model_path(config.model, config.revision)
        self.spec, self.model_impl = load_spec(model_path, config.model_impl)
        tok_path = resolve_model_path(config.tokenizer, config.revision) if config.tokenizer else model_path
        tok_begin = time.perf_counter()
        self.tokenizer = load_tokenizer(tok_path)
        startup.tokenizer = time.perf_counter() - tok_begin
        max_len = self.spec.max_position_embeddings
        if self.spec.sliding_window and self.model_impl == "transformers":
            # The fallback attends to the full context (the native layers honour their windows).
            max_len = min(max_len, self.spec.sliding_window)
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                window = " (its sliding window)" if max_len == self.spec.sliding_window else ""
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {max_len}{window}")
            max_len = config.max_model_len
        draft = self._load_draft(max_len)  # before the target's KV cache is sized: it takes a share
        startup.weights += time.perf_counter() - begin  # the runner adds the weights themselves
        self.runner = ModelRunner(
            config,
            self.spec,
            model_path,
            max_len,
            startup=startup,
            model_impl=self.model_impl,
            extra_block_bytes=draft.block_bytes(config.block_size) if draft is not None else 0,
        )
        if draft is not None:
            draft.allocate_kv(self.runner.num_blocks, config.block_size)
        spec_config = config.speculative_config
        assert not isinstance(spec_config, dict)  # EngineConfig turns a dict into SpeculativeConfig
        self.speculator = Speculator(spec_config, draft) if spec_config is not None else None
        kv_begin = time.perf_counter()
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            namespace=f"{model_path.resolve() if model_path.exists() else model_path}|{self.runner.dtype}",
        )
        startup.kv_cache += time.perf_counter() - kv_begin
        self.max_model_len = max_len
        # When every layer slides (Mistral), blocks that left the window are released as requests
        # run; with a draft model only if the draft's every layer slides too, no further back.
        self.release_window = (
            self.spec.sliding_window if self.model_impl == "native" and self.spec.sliding_layers is None else None
        )
        if draft is not None and not draft.reaches_no_further_than(self.release_window):
            self.release_window = None
        # A request never grows past what the whole cache can hold, so it always fits alone;
        # without chunked prefill it must also fit one step's budget, or (re)admitting it never
        # could happen.
        self.max_request_tokens = min(max_len, self.runner.num_blocks * config.block_size)
        if not config.enable_chunked_prefill:
            self.max_request_tokens = min(self.max_request_tokens, config.max_num_batched_tokens)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            admission=config.admission_policy,
            chunk_controller=make_chunk_controller(
                config.target_itl_ms, config.block_size, config.max_num_batched_tokens
            ),
        )
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = self.spec.vocab_size
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.runner.sampler.structured = self.structured
        self._groups: dict[str, list[Request]] = {}
        self._seq = itertools.count()
        self._pending: list[RequestOutput] = []
        self._steps = 0
        self._step_tokens_total = 0
        self._last_step_tokens = 0
        self._prompt_tokens_computed = 0
        self._generated_tokens = 0
        # The steps' intra-op threads: the budget (this rank's share of it under tensor
        # parallelism), or on CPU what the tuner picks under it.
        self._base_threads = self._step_threads = torch.get_num_threads()
        budget = self.cpu_budget
        tunable = self.runner.device.type == "cpu" and config.tensor_parallel_size == 1 and budget.derived
        self.thread_tuner = ThreadTuner(budget.threads) if tunable and budget.threads > 1 else None
        sync(self.runner.device)
        startup.total = time.perf_counter() - begin

    def _load_draft(self, max_len: int) -> DraftModel | None:
        spec_config = self.config.speculative_config
        if not isinstance(spec_config, SpeculativeConfig) or spec_config.method != "draft":
            return None
        device = self.config.resolve_device()
        return DraftModel(
            spec_config,
            self.spec,
            self.tokenizer,
            attention_backend=self.config.attention_backend,
            max_model_len=max_len,
            dtype=self.config.resolve_dtype(self.spec.checkpoint_dtype, device),
            device=device,
        )

    # ---- requests in ----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        deadline: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError`` naming what is wrong with bad input.

        ``priority`` (lower first) orders the queue under the ``priority`` policy; ``deadline``
        (wall-clock epoch seconds, ``time.time()``'s clock) under ``edf``, and breaks ties
        between equal priorities under ``priority``. Other policies ignore both."""
        if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if deadline is not None:
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline):
                raise ValueError(f"deadline must be a finite number of epoch seconds, got {deadline!r}")
            deadline = float(deadline)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            raise ValueError(
                f"logit_bias token id {bad[0]} is not in the vocabulary [0, {self.vocab_size})"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            )
        ids, text = self.tokenize(prompt)
        if len(ids) >= self.max_request_tokens:
            budget = "" if self.config.enable_chunked_prefill else ", max_num_batched_tokens without chunked prefill"
            raise ValueError(
                f"prompt is {len(ids)} tokens; this engine takes at most {self.max_request_tokens - 1} "
                f"(max_model_len {self.max_model_len}, KV cache {self.runner.num_blocks * self.config.block_size} "
                f"tokens{budget}) to leave room for one generated token"
            )
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
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
                    parent_id=request_id,
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
                    grammar=grammar.matcher() if grammar is not None else None,
                )
            )
        self._groups[request_id] = children
        for child in children:
            self.scheduler.add_request(child)

    def tokenize(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids (and the text, when there is one) of a prompt in any accepted form."""
        if isinstance(prompt, dict):
            keys = set(prompt) & {"prompt", "prompt_token_ids", "messages"}
            if len(keys) != 1:
                raise ValueError("a dict prompt needs exactly one of 'prompt', 'prompt_token_ids', 'messages'")
            key = keys.pop()
            tools = prompt.get("tools")
            if tools is not None and key != "messages":
                raise ValueError("tools go with messages (the chat template renders them)")
            if key == "messages":
                text = self._apply_chat_template(prompt["messages"], tools)
                return self._encode(text, "messages", add_special_tokens=False), text
            prompt = prompt[key]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            check_text(prompt, "prompt")
            return self._encode(prompt, "prompt", add_special_tokens=True), prompt
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt_token_ids is empty")
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt token id {t!r} is not in the vocabulary [0, {self.vocab_size})")
            return list(prompt), None
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # tokenizers raise several types; one request's problem, not the batch's
            raise ValueError(f"the tokenizer cannot encode the {field}: {type(exc).__name__}: {exc}") from None
        if not ids:
            raise ValueError(f"the {field} encodes to no tokens")
        return ids

    def _apply_chat_template(self, messages: Any, tools: Any = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise ValueError(f"messages has {len(messages)} entries; at most {MAX_CHAT_MESSAGES}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            content = m.get("content")
            if not isinstance(content, (str, list)) and content is not None:
                raise ValueError(f"messages[{i}].content must be a string or a list of parts")
            check_texts(m, f"messages[{i}]")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        checked: list[Any] | None = check_tools(tools) if tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=checked, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # template errors come in many types
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        assert isinstance(text, str)  # tokenize=False: the rendered text
        return text

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for req in self._groups.pop(rid, ()):
                if not req.finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                    req.metrics.finished_time = time.monotonic()
                    self._pending.append(self._output(req, [], ""))

    # ---- the loop ---------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        begin = time.perf_counter()
        spec = self.speculator
        if spec is not None:
            spec.plan(self.scheduler.running)
        sched = self.scheduler.schedule()
        tuner = self.thread_tuner
        if sched.requests:
            self._step_threads = tuner.before_step() if tuner is not None else self._base_threads
            if torch.get_num_threads() != self._step_threads:  # torch keeps it per thread: the stepping one's
                torch.set_num_threads(self._step_threads)
        step_begin = time.perf_counter()
        if spec is not None:
            spec.propose(sched, self.scheduler.running, lambda r: self.kv.block_ids(r.request_id))
        if not sched.requests:
            return outputs
        chunks = self.scheduler.chunk_controller
        # (a decode verifying k proposals computes 1 + k tokens: still a decode)
        prefills = (
            [
                is_prefill(req, n - sched.num_spec_tokens.get(req.request_id, 0))
                for req, n in zip(sched.requests, sched.num_new_tokens, strict=True)
            ]
            if chunks is not None
            else []
        )
        result = self.runner.execute(sched, lambda r: self.kv.block_ids(r.request_id))
        if tuner is not None:
            tuner.after_step(time.perf_counter() - step_begin, sched.total_tokens)
        for req, entries in result.prompt_logprobs:
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(entries)
        draft_on = spec is not None and spec.draft is not None
        now = time.monotonic()
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            if req.num_computed_tokens < req.num_prompt_tokens:
                self._prompt_tokens_computed += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
            if self.release_window is not None:
                # Proposals under verification may be rolled back: keep what the tokens that
                # surely stay (the computed ones less the proposals) can still attend to, and a
                # draft model, which may be a token behind the target, too.
                margin = sched.num_spec_tokens.get(req.request_id, 0) + (1 if draft_on else 0)
                self.kv.free_outside_window(req, self.release_window + margin)
        if result.output is not None:
            lp = result.output.logprobs
            for i, (req, token) in enumerate(zip(result.sampled, result.output.token_ids, strict=True)):
                self._advance_safely(req, [token], [lp[i]] if lp else None, now, outputs)
        if result.verified:
            assert spec is not None and result.verify_logits is not None
            verdicts = spec.verify(self.runner.sampler, result.verify_logits, result.verified)
            for req, verdict in zip(result.verified, verdicts, strict=True):
                self._advance_safely(req, verdict.token_ids, verdict.logprobs, now, outputs)
                if not req.finished:  # free the blocks that the rejected proposals alone held
                    self.kv.trim(req, req.num_computed_tokens)
        self.scheduler.drop_finished_running()
        if chunks is not None:
            chunks.observe(time.perf_counter() - begin, had_decodes=not all(prefills), had_prefill=any(prefills))
        self._steps += 1
        self._last_step_tokens = sched.total_tokens
        self._step_tokens_total += sched.total_tokens
        return outputs

    def _advance_safely(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[dict[int, float] | None] | None,
        now: float,
        outputs: list[RequestOutput],
    ) -> None:
        try:
            out = self._advance(req, tokens, logprobs, now)
            if out is not None:
                outputs.append(out)
        except Exception as exc:  # one request's failure must not sink the batch
            log.exception("request %s failed", req.parent_id)
            req.status = RequestStatus.FINISHED_ERROR
            req.error = f"{type(exc).__name__}: {exc}"
            req.metrics.finished_time = now
            self._forget(req)
            outputs.append(self._output(req, [], ""))

    def _advance(
        self, req: Request, tokens: list[int], logprobs: list[dict[int, float] | None] | None, now: float
    ) -> RequestOutput | None:
        """Append this step's tokens (one, or several verified by speculative decoding) up to
        the first that finishes the request; the rest are dropped."""
        status = None
        for i, token in enumerate(tokens):
            status = self._append(req, token, logprobs[i] if logprobs else None, now)
            if status is not None:
                break
        metrics = req.metrics
        if status is not None:
            req.status = status
            metrics.finished_time = now
            self.scheduler.record_finished(req)
            self._forget(req)
        elif not req.params.stream:
            return None
        new_ids = req.output_token_ids[req.num_emitted_tokens :]
        req.num_emitted_tokens = len(req.output_token_ids)
        return self._output(req, new_ids, self._take_text_delta(req))

    def _append(self, req: Request, token: int, logprobs: dict[int, float] | None, now: float) -> RequestStatus | None:
        """Append one token; the finished state it puts the request in, if any."""
        req.append_token(token)
        self._generated_tokens += 1
        metrics = req.metrics
        metrics.num_generated_tokens += 1
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if logprobs is not None and req.logprobs is not None:
            req.logprobs.append(logprobs)
        status = req.check_stop(token)
        if req.grammar is not None and req.grammar.accept(token) and status is None:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        detok = req.detokenizer
        stop_str = detok.add(token) if detok is not None else None
        if stop_str is not None:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = stop_str
        return status

    def _take_text_delta(self, req: Request) -> str:
        if req.detokenizer is not None:
            return req.detokenizer.take_delta(req.finished)
        return self._text(req) if req.finished else ""

    def _text(self, req: Request) -> str:
        if req.detokenizer is not None:
            return req.detokenizer.text
        if req.final_text is None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
            assert isinstance(text, str)  # one sequence in, one text out
            req.final_text = text
        return req.final_text

    def _forget(self, req: Request) -> None:
        group = self._groups.get(req.parent_id)
        if group is not None and all(r.finished for r in group):
            del self._groups[req.parent_id]

    def _output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        finished = req.finished
        return RequestOutput(
            request_id=req.parent_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=self._text(req),
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
            index=req.index,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            error=req.error,
            prompt=req.prompt_text,
        )

    def shutdown(self) -> None:
        """Stop the processes this engine started (tensor-parallel ranks); it runs no step after.
        Also done when the engine is garbage-collected or the process exits."""
        self.runner.shutdown()

    # ---- observability ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.kv
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
            num_steps=self._steps,
            last_step_tokens=self._last_step_tokens,
            avg_tokens_per_step=self._step_tokens_total / self._steps if self._steps else 0.0,
            num_prompt_tokens_computed=self._prompt_tokens_computed,
            num_generated_tokens=self._generated_tokens,
            spec_decode=self.speculator.stats.snapshot() if self.speculator is not None else None,
            cpu_threads=self._step_threads,
        )
