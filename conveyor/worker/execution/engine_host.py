"""The engine host: one ``LLMEngine`` per worker process, owned by one loop thread.

``LLMEngine`` is not thread-safe, so exactly one thread (the loop) ever calls it. Any
thread may ``submit`` a request (it gets a ``RequestHandle`` whose future resolves to a
``Completion``) or ``abort`` one. The loop drains submissions and aborts between steps, so
requests from many shard tasks join the running batch mid-flight; it sleeps on a condition
variable when there is nothing to do (no busy spin). A request the engine rejects (bad
input, prompt too long) resolves to a rejected ``Completion``; an exception inside a step
fails every in-flight future with ``EngineFailure`` (none is left hanging) and the loop
goes on with new requests, unless the engine can run no further step (``EngineDeadError``,
a tensor-parallel rank died): then the process exits, as after a crash.

Before that, a request's inputs are prepared on the threads of an ``InputStage`` (chat template,
tokenising, grammar compile: ``LLMEngine.prepare_input``), never on the loop thread, so one
line's slow input stalls no step; a line whose inputs are refused resolves with its error
code (``prompt_too_long``, ``grammar_too_complex``) and never takes a place in the engine.

Requests reach the engine through a ``FairFeed``: the loop holds them and passes them on
while the engine has fewer unfinished sequences than its ``max_num_seqs``, the next one from
the owner with the fewest in the engine, so one owner's backlog never stands in the
engine's queue ahead of another owner's first request.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine import EngineConfig, EngineDeadError, LLMEngine, RequestOutput, SamplingParams
from conveyor.engine.inputs.errors import InputRejected, error_code
from conveyor.worker.core.periodic import Periodic
from conveyor.worker.execution.fair_feed import FairFeed, OwnerLoad
from conveyor.worker.execution.input_stage import InputStage

log = logging.getLogger(__name__)


# Test-only, off unless set: a process whose engine gets a prompt containing this text
# dies on the spot, as if a kernel crashed on it (how tests make a poison item).
_TEST_CRASH_ON = os.environ.get("CONVEYOR_TEST_CRASH_ON") or None


# Test-only likewise: a prompt containing this text makes the engine hang (how tests make
# a poison item that hangs the worker instead of crashing it).
_TEST_HANG_ON = os.environ.get("CONVEYOR_TEST_HANG_ON") or None

# The exit status of a worker whose engine hung (a crash of the test hook exits 70).
HUNG_EXIT_CODE = 71
# ... and of one whose engine can run no further step (``EngineDeadError``: a tensor-parallel
# rank died): exiting hands its shards back through their leases, to be retried.
ENGINE_DEAD_EXIT_CODE = 72


def _crash_if_poison(prompt: Any) -> None:
    if _TEST_CRASH_ON is not None and _TEST_CRASH_ON in str(prompt):
        os._exit(70)
    if _TEST_HANG_ON is not None and _TEST_HANG_ON in str(prompt):
        threading.Event().wait()  # forever


class EngineFailure(RuntimeError):
    """The engine raised while running a request (not the request's fault)."""


class HostClosed(RuntimeError):
    """The engine host was shut down before the request finished."""


@dataclass
class Completion:
    """How a request ended: its final output per sample (``outputs[i].index == i``), or
    ``rejected`` with ``error`` when the engine refused it at submission."""

    request_id: str
    outputs: list[RequestOutput] = field(default_factory=list)
    rejected: bool = False
    error: str | None = None
    aborted_before_start: bool = False
    # Why it was rejected, as a result line's error code: ``invalid_request``,
    # ``prompt_too_long`` or ``grammar_too_complex``.
    code: str | None = None

    @property
    def aborted(self) -> bool:
        return self.aborted_before_start or any(o.finish_reason == "abort" for o in self.outputs)


@dataclass(eq=False)
class RequestHandle:
    """One submitted request. ``tag`` is the submitter's own data, handed back untouched."""

    request_id: str
    future: Future[Completion]
    tag: Any = None

    def done(self) -> bool:
        return self.future.done()


@dataclass
class HostStats:
    """The latest engine stats (refreshed by the loop thread) plus host counters."""

    engine: Any | None  # engine.EngineStats; None before the first refresh
    live_requests: int
    submitted: int
    finished: int
    updated_at: float  # time.time() of the engine stats
    # Per owner with work: requests in the engine and requests held for it (``FairFeed``).
    owners: tuple[OwnerLoad, ...] = ()


@dataclass(frozen=True)
class PromptList:
    """Several prompts submitted as one request (an embeddings line's inputs): each runs as
    its own engine request, and the handle resolves once all are done, with their outputs
    in order (``Completion.outputs[i]`` is prompt ``i``'s). One prompt the engine refuses
    refuses them all, naming it."""

    prompts: list[Any]
    name: str = "input"  # what a refusal calls prompt i: ``input[i]``, ``pair[i]``...


@dataclass
class _Submission:
    handle: RequestHandle
    prompt: Any
    params: SamplingParams
    priority: int
    deadline: float | None
    on_done: Callable[[RequestHandle], None] | None
    owner: str = ""
    # Set by the input stage: the engine's prepared inputs (one per prompt), or why they failed.
    prepared: list[Any] | None = None
    refusal: Exception | None = None

    @property
    def engine_ids(self) -> list[str]:
        """The engine's request ids of this submission."""
        rid = self.handle.request_id
        if isinstance(self.prompt, PromptList):
            return [f"{rid}#{i}" for i in range(len(self.prompt.prompts))]
        return [rid]

    @property
    def num_outputs(self) -> int:
        """The finished outputs that complete it (also the sequences it holds in the engine)."""
        return len(self.prompt.prompts) if isinstance(self.prompt, PromptList) else self.params.n


@dataclass
class _Live:
    submission: _Submission
    outputs: dict[int, RequestOutput] = field(default_factory=dict)


class EngineHost:
    """Owns an engine and the one thread allowed to drive it."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        stats_interval: float = 0.5,
        name: str = "conveyor-engine",
        step_timeout: float | None = None,
        input_threads: int = 2,
    ) -> None:
        self._engine = engine
        # When the loop thread's current engine work began (None while it waits): what the
        # watchdog reads. A hung step cannot be interrupted from Python, only ended with the
        # process; exiting turns the hang into a death, which the shard leases recover from
        # and which isolates the item that caused it (see execution/shard_runner.py).
        self._working_since: float | None = None
        self._step_timeout = step_timeout
        self._watchdog = (
            Periodic("conveyor-step-watchdog", min(5.0, step_timeout / 4), self._exit_if_hung, run_first=False).start()
            if step_timeout is not None
            else None
        )
        self._stats_interval = stats_interval
        self._cv = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: list[tuple[str, bool]] = []  # (request id, only if it has not started)
        self._closing = False
        self._ids = itertools.count()
        self._prefix = f"h{os.getpid()}-{id(self) & 0xFFFF:x}-"
        self._live: dict[str, _Live] = {}  # loop thread only
        # A ``PromptList``'s engine request ids -> (its handle's id, the prompt's index).
        self._parts: dict[str, tuple[str, int]] = {}  # loop thread only
        self._feed: FairFeed[_Submission] = FairFeed()  # loop thread only
        # How many sequences (a request's ``n`` samples each) the engine holds at once: its
        # running batch; more requests wait in the feed.
        self._window: int | None = getattr(getattr(engine, "config", None), "max_num_seqs", None)
        self._live_seqs = 0
        self._submitted = 0
        self._finished = 0
        self._stats = HostStats(None, 0, 0, 0, 0.0)
        self._stats_at = 0.0
        # Submissions handed to the input stage and not yet taken in by the loop, and aborts
        # that arrived while one was being prepared (resolved when it comes back).
        self._in_stage: set[str] = set()
        self._aborted_in_stage: set[str] = set()  # loop thread only
        # An engine that prepares inputs apart (``LLMEngine``; a test's stand-in may not);
        # ``input_threads=0``: on the loop thread, as ``add_request`` does by itself.
        self._stage: InputStage[_Submission, list[Any]] | None = (
            InputStage(self._prepare, self._prepared, threads=input_threads, name=f"{name}-input")
            if input_threads > 0 and callable(getattr(engine, "prepare_input", None))
            else None
        )
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> EngineHost:
        return cls(LLMEngine(config), **kwargs)

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (read-only use from other threads: decoding token ids)."""
        return self._engine.tokenizer

    @property
    def model_type(self) -> str | None:
        """The checkpoint's ``model_type`` (None for a stand-in engine that has no model)."""
        spec = getattr(self._engine, "model_spec", None)
        return getattr(spec, "model_type", None)

    @property
    def startup(self) -> Any:
        """How long the engine took to build, by phase (``conveyor.engine.StartupTimings``; None
        for an engine that keeps none, such as a test's stand-in)."""
        return getattr(self._engine, "startup", None)

    # ---- any thread -------------------------------------------------------------------

    def submit(
        self,
        prompt: Any,
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
        tag: Any = None,
        on_done: Callable[[RequestHandle], None] | None = None,
        owner: str = "",
    ) -> RequestHandle:
        """Queue a request for the engine; ``on_done(handle)`` runs (on the loop thread)
        once its future is resolved. Never blocks on the engine. ``priority`` and
        ``deadline`` (epoch seconds) are ``LLMEngine.add_request``'s; they order the
        request among ``owner``'s own (the feed shares the engine between owners)."""
        handle = RequestHandle(f"{self._prefix}{next(self._ids)}", Future(), tag)
        sub = _Submission(handle, prompt, params, priority, deadline, on_done, owner)
        with self._cv:
            if self._closing:
                raise HostClosed("the engine host is shut down")
            self._submitted += 1
            if self._stage is None:
                self._inbox.append(sub)
                self._cv.notify()
                return handle
            self._in_stage.add(handle.request_id)
        self._stage.put(handle.request_id, owner, sub, priority=priority, deadline=deadline)
        return handle

    def abort(self, handle: RequestHandle | str) -> None:
        """Stop a request; its future resolves with ``finish_reason == "abort"`` outputs
        (or outputs that finished first). Unknown or finished requests are ignored."""
        self._stop(handle, running_too=True)

    def withdraw(self, handle: RequestHandle) -> None:
        """Abort a request only if it has not reached the engine yet (being prepared or
        waiting in the feed); one the engine runs finishes as it would have."""
        self._stop(handle, running_too=False)

    def _stop(self, handle: RequestHandle | str, *, running_too: bool) -> None:
        request_id = handle if isinstance(handle, str) else handle.request_id
        with self._cv:
            self._aborts.append((request_id, running_too))
            self._cv.notify()

    def stats(self) -> HostStats:
        with self._cv:
            return self._stats

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still queued or running fail with ``HostClosed``."""
        if self._watchdog is not None:
            self._watchdog.stop()
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._stage is not None:
            for sub in self._stage.close():
                self._resolve(sub, HostClosed("the engine host shut down before the request finished"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop thread --------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        self._refresh_stats(force=True)
        while True:
            with self._cv:
                while not (self._inbox or self._aborts or busy or self._closing):
                    self._cv.wait()
                if self._closing:
                    inbox, self._inbox = self._inbox, []
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            pending_aborts: dict[str, bool] = {}
            for request_id, running_too in aborts:
                pending_aborts[request_id] = pending_aborts.get(request_id, False) or running_too
            self._working_since = time.monotonic()
            for sub in inbox:
                self._take_in(sub)
            for request_id, running_too in pending_aborts.items():
                held = self._feed.remove(request_id)
                if held is not None:  # aborted before it ever ran
                    self._resolve(held, Completion(request_id, aborted_before_start=True))
                elif request_id in self._live:
                    if running_too:
                        self._engine_call(self._engine.abort_request, self._live[request_id].submission.engine_ids)
                else:
                    self._abort_in_stage(request_id)
            self._admit()
            if self._engine_has_work():
                self._step()
            busy = self._engine_has_work() or bool(len(self._feed))
            self._working_since = None
            self._refresh_stats(force=not busy)
        self._shutdown(inbox)

    # ---- the input stage's threads ------------------------------------------------------

    def _prepare(self, sub: _Submission) -> list[Any]:
        """``sub``'s prompts prepared by the engine (on an input thread)."""
        prompts = sub.prompt.prompts if isinstance(sub.prompt, PromptList) else [sub.prompt]
        prepared = []
        for i, prompt in enumerate(prompts):
            try:
                prepared.append(self._engine.prepare_input(prompt, sub.params))
            except ValueError as exc:
                if not isinstance(sub.prompt, PromptList):
                    raise
                raise InputRejected(f"{sub.prompt.name}[{i}]: {exc}", error_code(exc)) from None
        return prepared

    def _prepared(self, sub: _Submission, prepared: list[Any] | None, error: Exception | None) -> None:
        sub.prepared, sub.refusal = prepared, error
        with self._cv:
            closing = self._closing
            if not closing:
                self._inbox.append(sub)
                self._cv.notify()
        if closing:
            self._resolve(sub, HostClosed("the engine host shut down before the request finished"))

    # ---- the loop thread, continued -------------------------------------------------------

    def _take_in(self, sub: _Submission) -> None:
        """A submission arrives (prepared, when there is an input stage): into the feed, or
        resolved now when its inputs were refused or it was aborted while being prepared."""
        rid = sub.handle.request_id
        with self._cv:
            self._in_stage.discard(rid)
        if rid in self._aborted_in_stage:
            self._aborted_in_stage.discard(rid)
            self._resolve(sub, Completion(rid, aborted_before_start=True))
        elif isinstance(sub.refusal, ValueError):
            self._resolve(sub, Completion(rid, rejected=True, error=str(sub.refusal), code=error_code(sub.refusal)))
        elif sub.refusal is not None:
            log.error("preparing a request failed", exc_info=sub.refusal)
            exc = sub.refusal
            self._resolve(sub, EngineFailure(f"the engine failed to prepare the request: {type(exc).__name__}: {exc}"))
        else:
            self._feed.put(rid, sub.owner, sub, priority=sub.priority, deadline=sub.deadline)

    def _abort_in_stage(self, request_id: str) -> None:
        with self._cv:
            in_stage = request_id in self._in_stage
        if not in_stage or self._stage is None:
            return  # unknown or finished: ignored
        waiting = self._stage.remove(request_id)
        if waiting is not None:
            with self._cv:
                self._in_stage.discard(request_id)
            self._resolve(waiting, Completion(request_id, aborted_before_start=True))
        else:  # being prepared, or back in the inbox: resolved as aborted when taken in
            self._aborted_in_stage.add(request_id)

    def _exit_if_hung(self) -> None:
        since, limit = self._working_since, self._step_timeout
        if since is None or limit is None or time.monotonic() - since < limit:
            return
        log.critical(
            "the engine has not returned for %.0f s (CONVEYOR_STEP_TIMEOUT_SECONDS=%g) with %d requests in "
            "flight: exiting, so that a hang is recovered like a crash",
            time.monotonic() - since,
            limit,
            len(self._live),
        )
        logging.shutdown()
        os._exit(HUNG_EXIT_CODE)

    def _engine_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            log.exception("engine call %s failed", getattr(fn, "__name__", fn))
            return None

    def _engine_has_work(self) -> bool:
        return bool(self._engine_call(self._engine.has_unfinished_requests))

    def _admit(self) -> None:
        """Pass held requests to the engine while it has room, fairly between owners."""
        while len(self._feed) and (self._window is None or self._live_seqs < self._window):
            taken = self._feed.pop()
            assert taken is not None
            owner, sub = taken
            if not self._add(sub):
                self._feed.done(owner)

    def _drop_live(self, request_id: str) -> _Live:
        entry = self._live.pop(request_id)
        self._feed.done(entry.submission.owner)
        self._live_seqs -= entry.submission.num_outputs
        if isinstance(entry.submission.prompt, PromptList):
            for engine_id in entry.submission.engine_ids:
                self._parts.pop(engine_id, None)
        return entry

    def _add(self, sub: _Submission) -> bool:
        """Give the engine ``sub``; False if it was resolved at once (refused or failed)."""
        rid = sub.handle.request_id
        _crash_if_poison(sub.prompt)
        many = isinstance(sub.prompt, PromptList)
        prompts: list[Any]
        if sub.prepared is not None:
            prompts = sub.prepared
        else:
            prompts = sub.prompt.prompts if isinstance(sub.prompt, PromptList) else [sub.prompt]
        added: list[str] = []
        try:
            for engine_id, prompt in zip(sub.engine_ids, prompts, strict=True):
                self._engine.add_request(engine_id, prompt, sub.params, priority=sub.priority, deadline=sub.deadline)
                added.append(engine_id)
        except ValueError as exc:
            if added:  # their abort outputs come back unclaimed, and are skipped
                self._engine_call(self._engine.abort_request, added)
            name = sub.prompt.name if isinstance(sub.prompt, PromptList) else "input"
            message = f"{name}[{len(added)}]: {exc}" if many else str(exc)
            self._resolve(sub, Completion(rid, rejected=True, error=message, code=error_code(exc)))
            return False
        except Exception as exc:
            log.exception("engine.add_request failed")
            self._resolve(sub, EngineFailure(f"the engine failed to take the request: {type(exc).__name__}: {exc}"))
            return False
        self._live[rid] = _Live(sub)
        self._live_seqs += sub.num_outputs
        if many:
            self._parts.update({engine_id: (rid, i) for i, engine_id in enumerate(added)})
        return True

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except EngineDeadError as exc:
            log.critical("the engine cannot run again (%s) with %d requests in flight: exiting", exc, len(self._live))
            logging.shutdown()
            os._exit(ENGINE_DEAD_EXIT_CODE)
        except Exception as exc:
            log.exception("engine step failed; failing %d in-flight requests", len(self._live))
            failure = EngineFailure(f"the engine failed during a step: {type(exc).__name__}: {exc}")
            for rid in list(self._live):
                entry = self._drop_live(rid)
                self._engine_call(self._engine.abort_request, entry.submission.engine_ids)
                self._resolve(entry.submission, failure)
            return
        for out in outputs:
            if not out.finished:
                continue
            rid, index = self._parts.get(out.request_id, (out.request_id, out.index))
            live_entry = self._live.get(rid)
            if live_entry is None:  # a late abort of a request already failed
                continue
            live_entry.outputs[index] = out
            if len(live_entry.outputs) == live_entry.submission.num_outputs:
                self._drop_live(rid)
                ordered = [live_entry.outputs[i] for i in sorted(live_entry.outputs)]
                self._resolve(live_entry.submission, Completion(rid, ordered))

    def _resolve(self, sub: _Submission, outcome: Completion | BaseException) -> None:
        if isinstance(outcome, BaseException):
            sub.handle.future.set_exception(outcome)
        else:
            sub.handle.future.set_result(outcome)
        with self._cv:
            self._finished += 1
        if sub.on_done is not None:
            try:
                sub.on_done(sub.handle)
            except Exception:
                log.exception("on_done callback failed")

    def _refresh_stats(self, force: bool) -> None:
        t = time.monotonic()
        if not force and t - self._stats_at < self._stats_interval:
            return
        self._stats_at = t
        engine_stats = self._engine_call(self._engine.stats)
        owners = tuple(self._feed.loads())
        with self._cv:
            preparing = len(self._in_stage)
            self._stats = HostStats(
                engine_stats,
                len(self._live) + len(self._feed) + preparing,
                self._submitted,
                self._finished,
                time.time(),
                owners,
            )

    def _shutdown(self, inbox: list[_Submission]) -> None:
        closed = HostClosed("the engine host shut down before the request finished")
        for sub in [*inbox, *self._feed.drain()]:
            self._resolve(sub, closed)
        live, self._live = self._live, {}
        for entry in live.values():
            self._resolve(entry.submission, closed)
        self._refresh_stats(force=True)
