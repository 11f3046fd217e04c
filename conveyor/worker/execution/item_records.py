"""Between a parsed input line and a stored item: the engine prompt going in, and the
``ItemRecord`` (response body or error, usage, per-item metrics) coming out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conveyor.engine import RequestOutput, SamplingParams
from conveyor.engine.sample.token_pieces import TokenPieces
from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.anthropic_message import MessageOutput, message_object
from conveyor.worker.batchio.output_lines import Choice, response_body, stable_id
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.batchio.request_body import CHAT
from conveyor.worker.batchio.responses_body import RESPONSES, response_object
from conveyor.worker.batchio.tools import ToolRequest, answer
from conveyor.worker.execution.engine_host import Completion, PromptList
from conveyor.worker.execution.reasoning import NO_REASONING, Reasoning
from conveyor.worker.store.items import ItemRecord
from conveyor.worker.store.models import ItemStatus

Decode = Callable[[list[int]], str]
NO_TEMPLATE = (
    "the job asks for chat (--chat, chat=true) but this model's tokenizer has no chat template; submit it with "
    "--no-chat (chat=false) to send prompts as they are"
)


def clean_text(text: str) -> str:
    """Model text as stored: NUL becomes U+FFFD (PostgreSQL's JSONB and text refuse NUL)."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


@dataclass(frozen=True)
class ItemContext:
    """What every item of one shard shares."""

    job_id: str
    model: str
    shard_index: int
    worker_id: str


def engine_prompt(req: ParsedRequest, *, chat_template: bool = False, reasoning: Reasoning = NO_REASONING) -> Any:
    """The prompt in the form ``LLMEngine.add_request`` takes. ``chat_template``: the model's
    tokenizer has one, so a ``prompt`` row in auto chat mode is rendered through it (as one
    user message after the job's system prompt); the engine renders messages, once.
    ``ValueError`` when the job asks for chat and the model has no template."""
    if req.inputs is not None:
        return PromptList(list(req.inputs))
    if req.pairs is not None:  # each pair scored as its own engine request (``conveyor.engine.pooling.scoring``)
        name = "documents" if req.rerank is not None else "pair"
        return PromptList([{"text_pair": list(pair)} for pair in req.pairs], name)
    if req.messages is not None:
        prompt: dict[str, Any] = {"messages": req.messages}
        if req.tools:
            prompt["tools"] = req.tools.tools
        kwargs = reasoning.template_kwargs(req)
        if kwargs:
            prompt["chat_template_kwargs"] = kwargs
        return prompt
    if req.chat is True and not chat_template:
        raise ValueError(NO_TEMPLATE)
    if isinstance(req.prompt, str) and (req.chat or (req.chat is None and chat_template)):
        system = [{"role": "system", "content": req.system_prompt}] if req.system_prompt else []
        return {"messages": [*system, {"role": "user", "content": req.prompt}]}
    return req.prompt


def sampling_params(
    req: ParsedRequest, cache_salt: str | None = None, reasoning: Reasoning = NO_REASONING
) -> SamplingParams:
    """``SamplingParams`` of a request (``ValueError`` naming the field if the engine refuses).
    Final-only: the engine host keeps only finished outputs, so the engine need not build
    one per step. ``cache_salt`` (its job's, ``execution.cache_salt``) always wins over the line."""
    return SamplingParams(**{**req.sampling, **reasoning.sampling(req), "stream": False, "cache_salt": cache_salt})


def error_record(
    ctx: ItemContext, req: ParsedRequest, *, code: str, message: str, status_code: int, param: str | None = None
) -> ItemRecord:
    return ItemRecord(
        job_id=ctx.job_id,
        custom_id=req.custom_id,
        shard_index=ctx.shard_index,
        line=req.line,
        status=ItemStatus.failed,
        status_code=status_code,
        request_id=stable_id("req_", ctx.job_id, req.custom_id),
        error={"code": code, "message": clean_text(message), "param": param},
        worker_id=ctx.worker_id,
    )


def completion_record(
    ctx: ItemContext,
    req: ParsedRequest,
    completion: Completion,
    pieces: TokenPieces,
    decode: Decode | None = None,
    reasoning: Reasoning = NO_REASONING,
) -> ItemRecord:
    """The stored item for a request the engine finished (or refused). ``decode`` gives the
    text of a prompt sent as token ids, for ``echo``."""
    if completion.rejected:
        return error_record(
            ctx, req, code=completion.code or "invalid_request", message=completion.error or "rejected", status_code=400
        )
    outputs = completion.outputs
    failed = next((o for o in outputs if o.finish_reason == "error"), None)
    if failed is not None:
        return error_record(
            ctx,
            req,
            code="engine_error",
            message=failed.error or "the engine failed on this request",
            status_code=500,
        )
    top = req.sampling.get("logprobs")
    echoed = _echoed_prompt(req, outputs[0], decode)
    choices = [
        Choice(
            clean_text(echoed + o.text),
            o.finish_reason,
            _logprobs(req.endpoint, o, top, pieces, echoed=len(echoed) if req.echo else None)
            if top is not None
            else None,
        )
        for o in outputs
    ]
    if req.messages is not None:
        choices = [_split_reasoning(c, o, reasoning) for c, o in zip(choices, outputs, strict=True)]
    if req.tools is not None:
        choices = tool_choices(ctx.job_id, req.custom_id, req.tools, choices)
    first = outputs[0]
    prompt_tokens = len(first.prompt_token_ids)
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    if req.endpoint == RESPONSES:
        body = _response_object(ctx, req, choices[0], prompt_tokens, completion_tokens, first.num_cached_tokens)
    elif req.endpoint == MESSAGES:
        out = MessageOutput(
            message_id=stable_id("msg_", ctx.job_id, req.custom_id), model=ctx.model, text=choices[0].text,
            reasoning=choices[0].reasoning, tool_calls=choices[0].tool_calls, finish_reason=choices[0].finish_reason,
            stop_reason=first.stop_reason, prompt_tokens=prompt_tokens, cached_tokens=first.num_cached_tokens,
            output_tokens=completion_tokens,
        )  # fmt: skip
        body = message_object(out, (req.echoed or {}).get("stop_sequences", ()))
    else:
        prefix = "chatcmpl-" if req.endpoint == CHAT else "cmpl-"
        body = response_body(
            req.endpoint,
            response_id=stable_id(prefix, ctx.job_id, req.custom_id),
            model=ctx.model,
            created=int(time.time()),
            choices=choices,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=first.num_cached_tokens,
            reasoning_field=reasoning.field,
        )
    m = first.metrics
    e2e = [o.metrics.e2e_latency for o in outputs if o.metrics.e2e_latency is not None]
    return ItemRecord(
        job_id=ctx.job_id,
        custom_id=req.custom_id,
        shard_index=ctx.shard_index,
        line=req.line,
        status=ItemStatus.succeeded,
        status_code=200,
        request_id=stable_id("req_", ctx.job_id, req.custom_id),
        response=body,
        finish_reason=first.finish_reason,
        prompt_tokens=prompt_tokens,
        cached_tokens=first.num_cached_tokens,
        completion_tokens=completion_tokens,
        reasoning_tokens=sum(c.reasoning_tokens for c in choices),
        preemptions=sum(o.metrics.num_preemptions for o in outputs),
        queue_time=m.queue_time,
        ttft=m.time_to_first_token,
        tpot=m.time_per_output_token,
        e2e=max(e2e) if e2e else None,
        worker_id=ctx.worker_id,
    )


def _split_reasoning(c: Choice, out: RequestOutput, reasoning: Reasoning) -> Choice:
    """A chat sample's thinking apart from its answer (tool calls are then read from the
    answer only), with the count of its thinking tokens."""
    text = reasoning.visible(c.text)
    opened = reasoning.parser.opened_in_prompt(out.prompt)
    split = reasoning.parser.split(text, opened_in_prompt=opened)
    if split.reasoning is None and split.content == text:
        return c if text == c.text else dataclasses.replace(c, text=text)
    tokens = reasoning.reasoning_tokens(out.token_ids, split.reasoning)
    return dataclasses.replace(c, text=split.content, reasoning=split.reasoning, reasoning_tokens=tokens)


def _response_object(
    ctx: ItemContext, req: ParsedRequest, c: Choice, prompt_tokens: int, completion_tokens: int, cached: int
) -> dict[str, Any]:
    def item_id(prefix: str, k: int) -> str:
        return stable_id(prefix, ctx.job_id, req.custom_id, str(k))

    return response_object(
        response_id=stable_id("resp_", ctx.job_id, req.custom_id),
        model=ctx.model,
        created=int(time.time()),
        body=req.echoed or {},
        reasoning=c.reasoning,
        text=c.text,
        tool_calls=c.tool_calls,
        finish_reason=c.finish_reason,
        input_tokens=prompt_tokens,
        output_tokens=completion_tokens,
        reasoning_tokens=c.reasoning_tokens,
        cached_tokens=cached,
        item_id=item_id,
    )


def _echoed_prompt(req: ParsedRequest, out: RequestOutput, decode: Decode | None) -> str:
    """What ``echo`` puts in front of the text: the prompt as sent, or its token ids' text."""
    if not req.echo:
        return ""
    if out.prompt is not None:
        return out.prompt
    if decode is None:
        raise ValueError("echo of a token-id prompt needs a decode function")
    return decode(out.prompt_token_ids)


def tool_choices(job_id: str, custom_id: str, tools: ToolRequest, choices: list[Choice]) -> list[Choice]:
    """The choices of a request with tools, with the calls each one made (ids are stable:
    a redelivered shard writes the same lines)."""
    out = []
    for i, c in enumerate(choices):

        def call_id(k: int, i: int = i) -> str:
            return stable_id("call_", job_id, custom_id, str(i), str(k))

        a = answer(tools, c.text, c.finish_reason, call_id)
        out.append(dataclasses.replace(c, text=a.content or "", finish_reason=a.finish_reason, tool_calls=a.tool_calls))
    return out


def _logprobs(
    endpoint: str, out: RequestOutput, top: int, pieces: TokenPieces, *, echoed: int | None = None
) -> dict[str, Any] | None:
    """The engine's per-token ``{token_id: logprob}`` in the endpoint's OpenAI shape (chat's
    ``bytes`` are each token's own bytes, also where its text alone is part of a character).
    ``echoed``: the length of the echoed prompt in front of a completion's text, whose tokens
    come first (the first with no logprob, as OpenAI gives it)."""
    if out.logprobs is None:
        return None

    def text(token_id: int) -> str:
        return clean_text(pieces.text_of(token_id))

    def rank(token_id: int, entry: dict[int, float]) -> tuple[tuple[int, float | None], list[tuple[int, float]]]:
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top]
        lp = entry.get(token_id)
        return (token_id, None if lp is None else _finite(lp)), [(t, _finite(p)) for t, p in ranked]

    chosen: list[tuple[int, float | None]] = []
    alternatives: list[list[tuple[int, float]] | None] = []
    offsets: list[int] = []
    if echoed is not None and endpoint != CHAT and out.prompt_logprobs is not None:
        pos = 0
        for token_id, prompt_entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            offsets.append(pos)
            pos += len(text(token_id))
            if prompt_entry is None:
                chosen.append((token_id, None))
                alternatives.append(None)
            else:
                c, alts = rank(token_id, prompt_entry)
                chosen.append(c)
                alternatives.append(alts)
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=False):
        c, alts = rank(token_id, entry)
        chosen.append(c)
        alternatives.append(alts)
    if endpoint == CHAT:
        return {
            "content": [
                {
                    "token": text(token_id),
                    "logprob": lp,
                    "bytes": list(pieces.bytes_of(token_id)),
                    "top_logprobs": [
                        {"token": text(t), "logprob": p, "bytes": list(pieces.bytes_of(t))} for t, p in alts
                    ],
                }
                for (token_id, lp), alts in zip(chosen, alternatives, strict=True)
                if alts is not None
            ],
            "refusal": None,
        }
    pos = echoed or 0  # the generated tokens' offsets count from the end of the echoed prompt
    for token_id, _ in chosen[len(offsets) :]:
        offsets.append(pos)
        pos += len(text(token_id))
    return {
        "tokens": [text(token_id) for token_id, _ in chosen],
        "token_logprobs": [lp for _, lp in chosen],
        "top_logprobs": [None if alts is None else {text(t): p for t, p in alts} for alts in alternatives],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf (Postgres JSONB refuses it): clamp to a very small number."""
    value = float(logprob)
    return value if value > -1e30 else -9999.0
