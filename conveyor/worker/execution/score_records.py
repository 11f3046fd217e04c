"""The stored item of a score or rerank request: vLLM's score or rerank response, one score
per pair, from the engine's outputs (``EngineHost``'s ``PromptList``). A model without a
scoring head refuses every pair with its reason: the line's error."""

from __future__ import annotations

import time

from conveyor.worker.batchio.output_lines import stable_id
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.batchio.rerank_body import rerank_response
from conveyor.worker.batchio.score_body import score_response
from conveyor.worker.execution.engine_host import Completion
from conveyor.worker.execution.item_records import ItemContext, error_record
from conveyor.worker.store.items import ItemRecord
from conveyor.worker.store.models import ItemStatus


def score_record(ctx: ItemContext, req: ParsedRequest, completion: Completion) -> ItemRecord:
    """The item for a score or rerank request the engine finished (or refused)."""
    assert req.pairs is not None  # (only score and rerank requests come here)
    if completion.rejected:
        return error_record(
            ctx, req, code=completion.code or "invalid_request", message=completion.error or "rejected", status_code=400
        )
    outputs = completion.outputs
    failed = next((o for o in outputs if o.finish_reason == "error" or o.score is None), None)
    if failed is not None:
        return error_record(
            ctx, req, code="engine_error", message=failed.error or "the engine gave no score", status_code=500
        )
    scores = [float(o.score) for o in outputs if o.score is not None]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    if req.rerank is not None:
        body = rerank_response(
            scores,
            [pair[1] for pair in req.pairs],
            req.rerank,
            response_id=stable_id("rerank-", ctx.job_id, req.custom_id),
            model=ctx.model,
            prompt_tokens=prompt_tokens,
        )
    else:
        body = score_response(
            scores,
            response_id=stable_id("score-", ctx.job_id, req.custom_id),
            created=int(time.time()),
            model=ctx.model,
            prompt_tokens=prompt_tokens,
        )
    m = outputs[0].metrics
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
        finish_reason="stop",
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
        completion_tokens=0,
        preemptions=sum(o.metrics.num_preemptions for o in outputs),
        queue_time=m.queue_time,
        ttft=None,  # no token is generated
        tpot=None,
        e2e=max(e2e) if e2e else None,
        worker_id=ctx.worker_id,
    )
