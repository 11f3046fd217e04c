"""Rank 0's side of tensor parallelism: start ranks 1..N-1 (``spawn``), join them in a
process group over a TCP store, send each step's inputs, watch them, and stop them.

A rank that dies takes the engine down: rank 0's watcher thread sees its process exit and
records why; the step in flight fails (the dead rank's sockets close, or, on NCCL, the
watcher aborts the group) and every later step raises the same ``EngineDeadError`` at once.
The ranks exit when rank 0's process does (each watches its parent) or on ``close``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.parallel_state import ParallelState
from conveyor.engine.distributed.rank_args import COLLECTIVE_TIMEOUT, HOST, RankArgs
from conveyor.engine.distributed.rank_worker import RunnerFactory
from conveyor.engine.distributed.rank_worker import main as rank_main
from conveyor.engine.distributed.step_inputs import StepInputs, stop_header
from conveyor.engine.errors import EngineDeadError

log = logging.getLogger(__name__)

# How long rank 0 waits for the other ranks to join, and for a failing rank's exit to show.
JOIN_TIMEOUT_S = 300.0
EXIT_GRACE_S = 5.0


class RankGroup:
    """Ranks 1..N-1 of one engine, started by ``start`` from rank 0 (this process), which
    becomes rank 0 of the group (``parallel_state.current()``)."""

    def __init__(self, procs: list[Any], doorbells: list[Connection], device: torch.device) -> None:
        self.procs = procs
        self.doorbells = doorbells  # rank 0's write ends of each rank's step pipe
        self.device = device
        self.failure: str | None = None  # why the group is broken, once it is
        self._closed = False
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="tp-rank-watcher", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, base: RankArgs, device: torch.device, runner_factory: RunnerFactory) -> RankGroup:
        """Spawn the other ranks, join the process group as rank 0 and set this process's
        ``parallel_state``. Fails with the reason when a rank dies before it joins. Each rank
        builds its runner with ``runner_factory`` (the model runner's class: passed in, so
        this package never imports the runner that imports it)."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process; shut it down first")
        ctx = mp.get_context("spawn")
        # Port 0: the store takes a free port, which the ranks are told.
        store = dist.TCPStore(HOST, 0, base.world_size, is_master=True, wait_for_workers=False)
        procs, doorbells = [], []
        for rank in range(1, base.world_size):
            read, write = ctx.Pipe(duplex=False)
            args = dataclasses.replace(base, rank=rank, port=store.port)
            proc = ctx.Process(
                target=rank_main, args=(args, read, runner_factory), name=f"conveyor-tp-rank-{rank}", daemon=True
            )
            proc.start()
            read.close()  # the rank's end: rank 0 keeps only the write end, so a dead rank's pipe breaks
            procs.append(proc)
            doorbells.append(write)
        group = cls(procs, doorbells, device)
        try:
            group._wait_for_ranks(store)
            dist.init_process_group(
                base.backend, store=store, rank=0, world_size=base.world_size, timeout=COLLECTIVE_TIMEOUT
            )
        except BaseException:
            group.close()
            raise
        parallel_state.set_state(ParallelState(0, base.world_size, dist.group.WORLD))
        return group

    def _wait_for_ranks(self, store: Any) -> None:
        """Each rank sets ``joined/<rank>`` in the store before it joins the group: wait for
        all of them, failing as soon as one has died instead."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        pending = {i + 1 for i in range(len(self.procs))}
        while pending:
            self.raise_if_failed()
            pending = {r for r in pending if not store.check([f"joined/{r}"])}
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {sorted(pending)} did not start in {JOIN_TIMEOUT_S:.0f} s")
            if pending:
                time.sleep(0.05)

    @property
    def pids(self) -> list[int]:
        """The other ranks' process ids, rank 1 first."""
        return [p.pid for p in self.procs]

    # ---- steps -------------------------------------------------------------------------
    def send_step(self, inputs: StepInputs) -> None:
        """Ring each rank's doorbell with the step's sizes, then broadcast its inputs."""
        import torch.distributed as dist

        self.raise_if_failed()
        header = inputs.header()
        for pipe in self.doorbells:
            pipe.send_bytes(header)
        dist.broadcast(inputs.pack(self.device), src=0)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        if self._closed:
            raise EngineDeadError("the tensor-parallel ranks are shut down")

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """Inside: a failure (a collective's, say) is raised as ``error`` says, naming the rank."""
        try:
            yield
        except Exception as exc:
            raise self.error(exc) from exc

    def error(self, exc: BaseException) -> EngineDeadError:
        """The error to raise for ``exc``, an exception from a step: which rank died, when one
        did (its exit may take a moment to show)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while self.failure is None and time.monotonic() < deadline:
            if not self._record_exits():
                time.sleep(0.05)
        if self.failure is None:
            self.failure = f"tensor-parallel step failed: {type(exc).__name__}: {exc}"
        return EngineDeadError(self.failure)

    # ---- watching and stopping ---------------------------------------------------------
    def _record_exits(self, procs: list[Any] | None = None) -> bool:
        """Record the death of one of ``procs`` (default: all ranks), if one has exited. One
        death brings the others down (their collectives fail): a rank killed by a signal is
        named first, then the lowest rank."""
        ranks = {id(p): r for r, p in enumerate(self.procs, start=1)}
        dead = [p for p in (procs or self.procs) if p.exitcode is not None]
        if not dead:
            return False
        proc = min(dead, key=lambda p: (p.exitcode >= 0, ranks[id(p)]))
        with self._lock:
            if self.failure is None and not self._closed:
                self.failure = f"tensor-parallel rank {ranks[id(proc)]} died (exit code {proc.exitcode})"
        return True

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        while not self._closed:
            ready = wait(sentinels, timeout=0.5)
            if ready and not self._closed:
                first = [p for p in self.procs if p.sentinel in ready]
                for proc in first:  # its sentinel shows before its exit code can be read
                    proc.join(EXIT_GRACE_S)
                self._record_exits(first)
                log.error("%s; the engine cannot run further steps", self.failure)
                self._abort_collectives()
                return

    def _abort_collectives(self) -> None:
        """Unblock rank 0 when it waits on the dead rank in an NCCL collective (gloo's
        collectives fail on their own once the dead rank's sockets close)."""
        if self.device.type != "cuda":
            return
        with contextlib.suppress(Exception):
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()

    def close(self) -> None:
        """Stop the ranks (a stop message, then terminate what is left) and leave the group."""
        import torch.distributed as dist

        with self._lock:
            if self._closed:
                return
            self._closed = True
        for pipe in self.doorbells:
            with contextlib.suppress(OSError):
                pipe.send_bytes(stop_header())
        deadline = time.monotonic() + EXIT_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(EXIT_GRACE_S)
        for pipe in self.doorbells:
            pipe.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        parallel_state.reset()
