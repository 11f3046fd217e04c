"""Job ids and where a job's objects live: everything under ``jobs/<job id>/``.

::

    jobs/<id>/input.jsonl | input.csv        the input as submitted
    jobs/<id>/invalid.jsonl                  errors-file lines of lines rejected at validation
    jobs/<id>/shards/000000.jsonl            one shard's valid requests (ParsedRequest.to_json)
    jobs/<id>/parts/results-000000.jsonl     a finished shard's results, in input order
    jobs/<id>/results.jsonl                  the job's results file (all parts, in order)
    jobs/<id>/errors.jsonl                   the job's errors file, in input-line order
    jobs/<id>/unfinished.jsonl | .csv        a stopped job's unrun input lines, as submitted
"""

from __future__ import annotations

import re
import uuid

_JOB_ID = re.compile(r"^batch_[0-9a-f]{32}$")

INVALID = "invalid.jsonl"
RESULTS = "results.jsonl"
ERRORS = "errors.jsonl"


class InvalidJobId(ValueError):
    """Not a conveyor job id."""


def new_job_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def is_job_id(job_id: object) -> bool:
    return isinstance(job_id, str) and _JOB_ID.match(job_id) is not None


def check_job_id(job_id: str) -> str:
    """``job_id`` unchanged if well-formed (so it can never leave its key prefix)."""
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise InvalidJobId(f"{job_id!r:.80} is not a job id (they look like batch_ followed by 32 hex digits)")
    return job_id


def job_prefix(job_id: str) -> str:
    return f"jobs/{check_job_id(job_id)}"


def input_key(input_format: str) -> str:
    return {"csv": "input.csv", "parquet": "input.parquet"}.get(input_format, "input.jsonl")


def unfinished_key(input_format: str) -> str:
    """A cancelled or expired job's input lines that never ran, in the input's own format."""
    return {"csv": "unfinished.csv", "parquet": "unfinished.parquet"}.get(input_format, "unfinished.jsonl")


def shard_input_key(shard_index: int) -> str:
    return f"shards/{shard_index:06d}.jsonl"


def part_results_key(shard_index: int) -> str:
    return f"parts/results-{shard_index:06d}.jsonl"
