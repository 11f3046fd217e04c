"""How long an engine took to start, by phase, and when its process started.

``LLMEngine.startup`` is a ``StartupTimings`` filled while ``LLMEngine.__init__`` runs (the
model runner adds its own phases). A cold start is longer than that: the interpreter and
the imports come first. ``process_start_time`` says when the kernel started this process,
so a caller can measure from there (``conveyor bench --cold-start``, a worker's readiness).
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass

import torch

# Where each start time came from: the kernel's record of this process, psutil's (the same,
# read another way), or, where neither can be read, the moment this module was imported,
# which leaves out the interpreter's start and the imports before it (an underestimate).
KERNEL, PSUTIL, MODULE_IMPORT = "kernel", "psutil", "module import"
_IMPORTED_AT = time.time()


@dataclass
class StartupTimings:
    """Seconds spent in each phase of building an engine (wall clock).

    ``weights``: finding the checkpoint (a hub download included), its config, the tokenizer
    and the weights in place on the device; ``tokenizer`` is the tokenizer's part of it (the
    first one loaded in a process also imports much of transformers, lazily). ``kv_cache``:
    sizing and allocating the KV cache and its block pool. ``cuda_graphs``: capturing the
    decode graphs, None when none were captured (CPU, ``enforce_eager``, a backend that
    cannot be captured). ``total``: all of ``LLMEngine.__init__``, so ``total`` minus the
    phases is the rest (scheduler, checks).
    On CUDA each phase ends with a synchronize, so queued GPU work counts where it was queued.
    """

    started_at: float = 0.0  # time.time() when the engine began to load
    weights: float = 0.0
    tokenizer: float = 0.0  # included in weights
    kv_cache: float = 0.0
    cuda_graphs: float | None = None
    total: float = 0.0

    @property
    def other(self) -> float:
        """The engine's set-up besides the named phases (never negative)."""
        return max(0.0, self.total - self.weights - self.kv_cache - (self.cuda_graphs or 0.0))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a phase's time must include it); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def process_start_time() -> tuple[float, str]:
    """When this process started (``time.time()`` seconds) and where that came from
    (``KERNEL``, ``PSUTIL`` or ``MODULE_IMPORT``)."""
    kernel = _kernel_start_time()
    if kernel is not None:
        return kernel, KERNEL
    try:
        psutil = importlib.import_module("psutil")  # optional: not a dependency
    except ImportError:
        return _IMPORTED_AT, MODULE_IMPORT
    try:
        return float(psutil.Process().create_time()), PSUTIL
    except Exception:  # psutil raises its own error types where it cannot read the process
        return _IMPORTED_AT, MODULE_IMPORT


def _kernel_start_time() -> float | None:
    """Linux: ``/proc/self/stat``'s start time (clock ticks after boot), against the clock
    the kernel measures it on (``CLOCK_BOOTTIME``), as wall-clock seconds."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        # The command name (field 2) may hold spaces and parentheses: count after its ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = int(fields[19])  # field 22, starttime; the list begins at field 3
        hz = os.sysconf("SC_CLK_TCK")
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    age = since_boot - ticks / hz
    if not 0 <= age < 10 * 365 * 86400:
        return None
    return time.time() - age
