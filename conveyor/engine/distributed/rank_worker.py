"""What ranks 1..N-1 run: join rank 0's process group, build their shard of the model and
KV cache, then run every step rank 0 sends until it says stop. Rank 0 alone schedules and
samples; these ranks only run the forward pass (and hand their logits to rank 0).

A rank exits when rank 0's process is gone (a thread watches its parent), and on any error
(which rank 0 then reports), so no rank outlives the engine."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.parallel_state import ParallelState
from conveyor.engine.distributed.rank_args import COLLECTIVE_TIMEOUT, HOST, RankArgs
from conveyor.engine.distributed.step_inputs import StepInputs, is_stop, payload_size, unpack


class StepRunner(Protocol):
    device: torch.device

    def run_step(self, inputs: StepInputs) -> torch.Tensor | None: ...


# Builds a rank's runner: (config, model spec, model path, max model length, model_impl=...).
RunnerFactory = Callable[..., StepRunner]


def main(args: RankArgs, doorbell: Connection, runner_factory: RunnerFactory) -> None:
    _exit_with_parent()
    try:
        _serve(args, doorbell, runner_factory)
    except BaseException:  # any failure ends this rank; rank 0 sees the exit and reports it
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: nothing is left to flush and it can hang on NCCL


def _serve(args: RankArgs, doorbell: Connection, runner_factory: RunnerFactory) -> None:
    import torch.distributed as dist

    from conveyor.engine.attention.triton_backend import prepare_interpreter

    device = args.config.resolve_device()
    if device.type == "cuda":
        torch.cuda.set_device(args.rank)
    else:
        torch.set_num_threads(args.cpu_threads)
    if args.config.model.attention_backend == "triton":
        prepare_interpreter(device)
    store = dist.TCPStore(HOST, args.port, args.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(f"joined/{args.rank}", "1")
    dist.init_process_group(
        args.backend, store=store, rank=args.rank, world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT
    )
    parallel_state.set_state(ParallelState(args.rank, args.world_size, dist.group.WORLD))
    runner = runner_factory(
        args.config, args.model_spec, args.model_path, args.max_model_len, model_impl=args.model_impl
    )
    while True:
        try:
            header = doorbell.recv_bytes()
        except EOFError:  # rank 0 is gone
            return
        if is_stop(header):
            return
        payload = torch.empty(payload_size(header), dtype=torch.int64, device=runner.device)
        dist.broadcast(payload, src=0)
        runner.run_step(unpack(header, payload))


def _exit_with_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watcher", daemon=True).start()
