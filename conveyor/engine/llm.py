"""The offline entry point: a list of prompts in, a list of finished outputs out."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.core.llm_engine import LLMEngine, Prompt
from conveyor.engine.errors import EngineDeadError
from conveyor.engine.outputs import EmbeddingOutput, RequestMetrics, RequestOutput, ScoreOutput
from conveyor.engine.pooling.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams

Message = Mapping[str, Any]


class LLM:
    """``LLM(model, **engine_config).generate(prompts, params)``.

    ``model`` is a local checkpoint directory or a hub id; keyword arguments are
    ``EngineConfig``'s fields by their flat names (``dtype``, ``device``, ``block_size``,
    ``max_num_seqs``, ...) or its groups (``cache=CacheConfig(...)``, ``conveyor.engine.config``).

    ``with LLM(...) as llm:`` shuts it down on exit (``shutdown``); so does dropping the last
    reference to it, without waiting for the garbage collector.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._engine: LLMEngine | None = engine
        self._ids = itertools.count()
        # Bound to the engine, not to self: ``del llm`` frees this object at once (no cycle
        # through it), which stops the engine's tensor-parallel ranks there and then.
        self._finalizer = weakref.finalize(self, engine.shutdown)

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDeadError("this LLM is shut down; build another")
        return self._engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Release everything the engine holds: its tensor-parallel ranks (the process may
        then build another tensor-parallel engine), its weights and KV cache. Idempotent; the
        ``LLM`` runs nothing after it."""
        engine, self._engine = self._engine, None
        self._finalizer.detach()
        if engine is None:
            return
        engine.shutdown()
        del engine
        gc.collect()  # the engine's internals hold cycles: free the weights and KV cache now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """As vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}``
        messages) or a list of them, each rendered with the model's chat template (the
        assistant's turn opened) and generated as ``generate`` does, outputs in input order.
        ``chat_template_kwargs`` (template variables, e.g. ``enable_thinking``) and ``tools``
        apply to every conversation and are checked as a batch line's are."""
        if isinstance(messages, Mapping):
            raise ValueError("messages must be a list of message objects, or a list of such lists")
        conversations: list[Any] = list(messages)
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # one conversation
        prompts: list[Prompt] = []
        for i, conversation in enumerate(conversations):
            if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
                kind = type(conversation).__name__
                raise ValueError(f"messages[{i}] must be a conversation (a list of message objects), got {kind}")
            prompt: dict[str, Any] = {"messages": list(conversation)}
            if chat_template_kwargs is not None:
                prompt["chat_template_kwargs"] = dict(chat_template_kwargs)
            if tools is not None:
                prompt["tools"] = list(tools)
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. A prompt the engine rejects (too long, bad token ids...)
        gets an output with ``finish_reason='error'`` and the reason in ``error``; the others
        run. With ``n > 1`` a prompt contributes its ``n`` samples, consecutive, by ``index``."""
        prompt_list, params = _batch_arguments(prompts, sampling_params, priority)
        # Only final outputs are kept here: spare the engine the per-step streaming work.
        params = [p if not p.stream else dataclasses.replace(p, stream=False) for p in params]
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        finished: dict[tuple[str, int], RequestOutput] = {}
        for i, (rid, prompt, p) in enumerate(zip(ids, prompt_list, params, strict=True)):
            try:
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
            except ValueError as exc:
                for index in range(p.n):
                    finished[(rid, index)] = _error_output(rid, index, str(exc))
        self._run_until_done(finished, sum(p.n for p in params), use_tqdm)
        return [finished[(rid, index)] for rid, p in zip(ids, params, strict=True) for index in range(p.n)]

    def _run_until_done(self, finished: dict[tuple[str, int], RequestOutput], total: int, use_tqdm: bool) -> None:
        """Step the engine until no request is left, each final output into ``finished``."""
        engine = self.engine
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="generate", unit="req", initial=len(finished))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[(out.request_id, out.index)] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()

    def embed(
        self,
        texts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[EmbeddingOutput]:
        """One vector per input (a string or token ids), in input order, pooled as the
        checkpoint's sentence-transformers files say unless ``pooling_params`` overrides
        them. An input the engine rejects gets an empty vector and the reason in ``error``."""
        params = SamplingParams(pooling=pooling_params or PoolingParams())
        return [
            EmbeddingOutput(out.embedding or [], len(out.prompt_token_ids), out.error)
            for out in self.generate(texts, params, use_tqdm=use_tqdm)
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        use_tqdm: bool = False,
    ) -> list[ScoreOutput]:
        """As vLLM's ``LLM.score``: one relevance score per pair, in input order. ``text_1``
        one string is scored against every ``text_2`` (1:N); two lists of one length pair up
        (N:N). The model's scoring head computes it (``conveyor.engine.pooling.scoring``); a model
        without one, or a pair the engine rejects, gets ``score`` None and the reason in ``error``."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one, or as many")
        params = SamplingParams(pooling=PoolingParams(task="score"))
        prompts: list[Prompt] = [{"text_pair": [a, b]} for a, b in zip(firsts, seconds, strict=True)]
        return [
            ScoreOutput(out.score, len(out.prompt_token_ids), out.error)
            for out in self.generate(prompts, params, use_tqdm=use_tqdm)
        ]


def _batch_arguments(
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    priority: Sequence[int] | None,
) -> tuple[list[Prompt], list[SamplingParams]]:
    """``generate``'s prompts as a list (one prompt alone made a list of one) and a
    ``SamplingParams`` for each; ``ValueError`` when a list of params or priorities does not
    match the prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # a single prompt (token ids are a list too)
    prompt_list = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params or SamplingParams()] * len(prompt_list)
    else:
        params = list(sampling_params)
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompt_list)} prompts")
    if priority is not None and len(priority) != len(prompt_list):
        raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
    return prompt_list, params


def _error_output(request_id: str, index: int, message: str) -> RequestOutput:
    now = time.monotonic()
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=[],
        token_ids=[],
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        num_cached_tokens=0,
        metrics=RequestMetrics(arrival_time=now, finished_time=now),
        index=index,
        error=message,
    )
