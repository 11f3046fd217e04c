"""Validating a job's input and cutting it into shards, in one streamed pass.

While the input is parsed (``worker.formats.iter_input``) its bytes are copied to
``input.*``, each valid request is appended to its shard's file, and each rejected line
becomes an errors-file line in ``invalid.jsonl``. Memory stays at one line plus the list
of shard boundaries, whatever the input's size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from worker.batchio.line_reader import ByteStream
from worker.batchio.output_lines import dumps_line, line_error_line
from worker.batchio.readers import iter_input
from worker.batchio.records import InputError, InputFormat, LineError, ParsedRequest
from worker.batchio.request_options import RequestOptions
from worker.core.limits import InputLimits
from worker.jobs import object_keys
from worker.store.objects.base import ObjectStore, ObjectWriter


@dataclass
class ShardPlan:
    index: int
    first_line: int
    last_line: int
    num_items: int = 0


@dataclass
class IntakeResult:
    total: int = 0  # every non-blank input line
    invalid: int = 0  # lines rejected at validation
    shards: list[ShardPlan] = field(default_factory=list)
    endpoint: str | None = None  # the first valid request's (the job's endpoint)

    @property
    def valid(self) -> int:
        return self.total - self.invalid


class _Tee:
    """A binary stream that copies every byte read from ``source`` to ``sink``."""

    def __init__(self, source: ByteStream, sink: ObjectWriter) -> None:
        self._source, self._sink = source, sink

    def readline(self, size: int = -1) -> bytes:
        data = self._source.readline(size)
        if data:
            self._sink.write(data)
        return data

    def read(self, size: int = -1) -> bytes:
        data = self._source.read(size)
        if data:
            self._sink.write(data)
        return data


class _ShardWriter:
    """Appends requests to ``shards/NNNNNN.jsonl``, starting a new file every ``size``."""

    def __init__(self, job_store: ObjectStore, size: int, max_shards: int) -> None:
        self._store, self._size, self._max = job_store, size, max_shards
        self.plans: list[ShardPlan] = []
        self._writer: ObjectWriter | None = None

    def add(self, req: ParsedRequest) -> None:
        plan = self.plans[-1] if self.plans else None
        if plan is None or plan.num_items >= self._size:
            self._close_current()
            if len(self.plans) >= self._max:
                raise InputError(
                    f"the input needs more than {self._max} shards of {self._size} requests "
                    "(CONVEYOR_MAX_SHARDS_PER_JOB); use a larger shard size"
                )
            plan = ShardPlan(len(self.plans), req.line, req.line)
            self.plans.append(plan)
            self._writer = self._store.open_write(object_keys.shard_input_key(plan.index))
        assert self._writer is not None
        self._writer.write(dumps_line(req.to_json()))
        plan.num_items += 1
        plan.last_line = req.line

    def _close_current(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        self._close_current()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def ingest(
    source: ByteStream,
    job_store: ObjectStore,
    job_id: str,
    *,
    limits: InputLimits,
    input_format: InputFormat,
    shard_size: int,
    max_shards: int,
    copy_input: bool = True,
    options: RequestOptions | None = None,
) -> IntakeResult:
    """Validate ``source`` into ``job_store``; ``InputError`` if the input as a whole is
        unacceptable (nothing half-written is left as if it were complete; the error's
        ``endpoint`` is the first valid request's before the problem, if any). ``copy_input``
        False: the input is already stored (it is not copied to ``input.*``). ``options``: the job's
    request options, applied to every line as it is read."""
    result = IntakeResult()
    shards = _ShardWriter(job_store, shard_size, max_shards)
    with contextlib.ExitStack() as files:
        invalid = files.enter_context(job_store.open_write(object_keys.INVALID))
        if copy_input:
            source = _Tee(source, files.enter_context(job_store.open_write(object_keys.input_key(input_format.value))))
        try:
            for entry in iter_input(source, limits, input_format, options):
                result.total += 1
                if isinstance(entry, LineError):
                    result.invalid += 1
                    invalid.write(dumps_line(line_error_line(job_id, entry)))
                else:
                    if result.endpoint is None:
                        result.endpoint = entry.endpoint
                    shards.add(entry)
        except BaseException as exc:
            shards.abort()
            if isinstance(exc, InputError):
                exc.endpoint = result.endpoint
            raise
        shards.close()
    result.shards = shards.plans
    return result
