"""Validating a job's input and cutting it into shards, in one streamed pass.

While the input is parsed (``worker.formats.iter_input``) its bytes are copied to
``input.*`` and each rejected line becomes an errors-file line in ``invalid.jsonl``. Each
valid request goes to its shard's file: in input order, appended to the current shard
(memory stays at one line plus the list of shards); or, grouped by shared prefix (``grouping``),
through a sort by prefix signature in bounded memory (``conveyor.worker.jobs.prefix_sort``) and cut at
group boundaries once the input is read (``conveyor.worker.jobs.shard_cut``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from conveyor.worker.batchio.line_reader import ByteStream
from conveyor.worker.batchio.output_lines import dumps_line, line_error_line
from conveyor.worker.batchio.prefix_signature import canonical_prompt, signature_of_text
from conveyor.worker.batchio.readers import iter_input
from conveyor.worker.batchio.records import InputError, InputFormat, LineError, ParsedRequest
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import InputLimits
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.prefix_sort import PrefixSorter, SortRecord
from conveyor.worker.jobs.shard_cut import PrefixEstimate, cut_shards
from conveyor.worker.store.objects.base import ObjectStore, ObjectWriter


@dataclass
class ShardPlan:
    index: int
    first_line: int  # the smallest and largest input line in it
    last_line: int
    num_items: int = 0
    group_key: str | None = None  # grouped by prefix: the prefix its lines share


@dataclass(frozen=True)
class Grouping:
    """Shards cut by shared prefix: signatures under ``key`` (the cache salt and the model),
    sorted in memory up to ``memory_bytes``, in temporary run files beyond."""

    key: str
    memory_bytes: int
    temp_dir: str | None = None


@dataclass
class IntakeResult:
    total: int = 0  # every non-blank input line
    invalid: int = 0  # lines rejected at validation
    tokens: int = 0  # the output the valid lines may ask for: n x max_tokens summed
    shards: list[ShardPlan] = field(default_factory=list)
    endpoint: str | None = None  # the first valid request's (the job's endpoint)
    prefix: PrefixEstimate | None = None  # grouped: the intake's estimate of shared prefix

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
    """Writes requests to ``shards/NNNNNN.jsonl``: in input order, a new file every ``size``
    (``add``), or shard by shard as the caller cuts them (``start`` and ``write``)."""

    def __init__(self, job_store: ObjectStore, size: int, max_shards: int) -> None:
        self._store, self._size, self._max = job_store, size, max_shards
        self.plans: list[ShardPlan] = []
        self._writer: ObjectWriter | None = None

    def add(self, req: ParsedRequest) -> None:
        if not self.plans or self.plans[-1].num_items >= self._size:
            self.start()
        self.write(req.line, dumps_line(req.to_json()))

    def start(self, group_key: str | None = None) -> None:
        self._close_current()
        if len(self.plans) >= self._max:
            raise InputError(
                f"the input needs more than {self._max} shards of {self._size} requests "
                "(CONVEYOR_MAX_SHARDS_PER_JOB); use a larger shard size"
            )
        plan = ShardPlan(len(self.plans), 0, 0, group_key=group_key)
        self.plans.append(plan)
        self._writer = self._store.open_write(object_keys.shard_input_key(plan.index))

    def write(self, line: int, data: bytes) -> None:
        plan = self.plans[-1]
        assert self._writer is not None
        self._writer.write(data)
        plan.first_line = line if plan.num_items == 0 else min(plan.first_line, line)
        plan.last_line = max(plan.last_line, line)
        plan.num_items += 1

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


class _GroupedShards:
    """Collects valid requests with their prefix signatures; ``write`` cuts them into shards."""

    def __init__(self, grouping: Grouping) -> None:
        self._key = grouping.key
        self._sorter = PrefixSorter(grouping.memory_bytes, grouping.temp_dir)

    def add(self, req: ParsedRequest) -> None:
        sig = signature_of_text(canonical_prompt(req), self._key)
        self._sorter.add(SortRecord(sig.digests, req.line, sig.length, dumps_line(req.to_json())))

    def write(self, shards: _ShardWriter, size: int) -> PrefixEstimate:
        estimate = PrefixEstimate()
        for shard in cut_shards(self._sorter.sorted_records(), size, estimate):
            shards.start(shard.group_key)
            for rec in shard.records:
                shards.write(rec.line, rec.payload)
        return estimate

    def close(self) -> None:
        self._sorter.close()


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
    grouping: Grouping | None = None,
) -> IntakeResult:
    """Validate ``source`` into ``job_store``; ``InputError`` if the input as a whole is
        unacceptable (nothing half-written is left as if it were complete; the error's
        ``endpoint`` is the first valid request's before the problem, if any). ``copy_input``
        False: the input is already stored (it is not copied to ``input.*``). ``options``: the job's
    request options, applied to every line as it is read. ``grouping``: shards cut by shared
    prefix (None: in input order)."""
    result = IntakeResult()
    shards = _ShardWriter(job_store, shard_size, max_shards)
    with contextlib.ExitStack() as files:
        grouped = None if grouping is None else _GroupedShards(grouping)
        if grouped is not None:
            files.callback(grouped.close)
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
                    result.tokens += entry.sampling.get("n", 1) * entry.sampling.get(
                        "max_tokens", limits.default_max_tokens
                    )
                    (shards if grouped is None else grouped).add(entry)
            if grouped is not None:
                result.prefix = grouped.write(shards, shard_size)
        except BaseException as exc:
            shards.abort()
            if isinstance(exc, InputError):
                exc.endpoint = result.endpoint
            raise
        shards.close()
    result.shards = shards.plans
    return result
