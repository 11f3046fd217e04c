"""The stored item of an embeddings request: OpenAI's embeddings response, one vector per
input in input order, from the engine's outputs (``EngineHost``'s ``PromptList``)."""

from __future__ import annotations

from conveyor.worker.batchio.embeddings_body import embeddings_response
from conveyor.worker.batchio.output_lines import stable_id
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.execution.engine_host import Completion
from conveyor.worker.execution.item_records import ItemContext, error_record
from conveyor.worker.store.items import ItemRecord
from conveyor.worker.store.models import ItemStatus


def embedding_record(ctx: ItemContext, req: ParsedRequest, completion: Completion) -> ItemRecord:
    """The item for an embeddings request the engine finished (or refused: a model that
    cannot embed refuses every input with its reason)."""
    if completion.rejected:
        return error_record(
            ctx, req, code=completion.code or "invalid_request", message=completion.error or "rejected", status_code=400
        )
    failed = next((o for o in completion.outputs if o.finish_reason == "error" or o.embedding is None), None)
    if failed is not None:
        return error_record(
            ctx, req, code="engine_error", message=failed.error or "the engine gave no vector", status_code=500
        )
    outputs = completion.outputs
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    body = embeddings_response(
        [o.embedding or [] for o in outputs],
        model=ctx.model,
        encoding=req.encoding_format or "float",
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
        cached_tokens=cached,
        completion_tokens=0,
        preemptions=sum(o.metrics.num_preemptions for o in outputs),
        queue_time=m.queue_time,
        ttft=None,  # no token is generated
        tpot=None,
        e2e=max(e2e) if e2e else None,
        worker_id=ctx.worker_id,
    )
