"""A Message Batch's inline requests stored as its job's input, ``jobs/<id>/input.jsonl``: one
batch line per request, ``{"custom_id", "method": "POST", "url": "/v1/messages", "body":
params}``, which intake reads like any other job's (``conveyor.worker.batchio.records``
translates each body to chat; a body it cannot serve is that request's error); and their
custom_ids in ``jobs/<id>/custom_ids.txt``.

While the lines are written, what the create call must decide at once is learnt: how many
requests there are, the models they name, and the output tokens they may ask for (the
owner's quotas, as an uploaded file's ``BatchScan`` tells them).
"""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.worker.batchio.anthropic_batch_body import BatchRequest
from conveyor.worker.batchio.anthropic_body import MESSAGES
from conveyor.worker.batchio.batch_scan import MAX_COUNTED_TOKENS, MAX_MODELS, MAX_VALUE_CHARS, BatchScan
from conveyor.worker.batchio.output_lines import dumps_line
from conveyor.worker.jobs import object_keys
from conveyor.worker.store.objects.base import ObjectStore

INPUT = object_keys.input_key("jsonl")
# The batch's custom_ids, one a line: the input is a working object, deleted once the job has
# ended (``conveyor.worker.jobs.working_objects``), and the requests a cancel left unrun are
# named from this list in the results.
CUSTOM_IDS = "custom_ids.txt"


def store_requests(job_store: ObjectStore, requests: Iterable[BatchRequest]) -> BatchScan:
    """Write ``requests`` to the job's input, and their custom_ids; what they hold. Nothing
    is left behind when ``requests`` raises (the batch is refused)."""
    scan = BatchScan()
    # (an exception aborts both writes)
    with job_store.open_write(INPUT) as out, job_store.open_write(CUSTOM_IDS) as ids:
        for req in requests:
            out.write(dumps_line({"custom_id": req.custom_id, "method": "POST", "url": MESSAGES, "body": req.params}))
            ids.write(req.custom_id.encode("ascii") + b"\n")  # (custom_ids are [A-Za-z0-9_-])
            _count(scan, req)
    return scan


def _count(scan: BatchScan, req: BatchRequest) -> None:
    scan.lines += 1
    model = req.params.get("model")
    if not isinstance(model, str):
        scan.without_model += 1
    elif model[:MAX_VALUE_CHARS] not in scan.models:
        if len(scan.models) < MAX_MODELS:
            scan.models.append(model[:MAX_VALUE_CHARS])
        else:
            scan.more_models = True
    max_tokens = req.params.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        scan.requested_tokens += min(max_tokens, MAX_COUNTED_TOKENS)
    else:  # refused at intake: charged the default until then
        scan.default_token_samples += 1
    scan.urls = [MESSAGES]
