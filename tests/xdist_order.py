"""The order in which ``make test``'s processes take the test files (``--dist loadfile``).

xdist hands out files in collection order, and a process that picks up a long file near the end
runs it alone while the others sit idle. Starting the longest files first (the classic longest
processing time rule) lets the processes finish together. The list is measured: each file's
total seconds in ``pytest --junitxml`` on the 2-core machine with a cold Triton cache, longest
first; a file not named keeps its place after them. Refresh it from CI's ``--durations`` when the long files change.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST: tuple[str, ...] = (
    "tests/worker/entrypoints/test_autoscaling.py",  # 204 s
    "tests/benchmarks/test_gpu_check.py",  # 164 s (113 s before the kernel_shapes and models steps)
    "tests/worker/faults/test_broker_restart.py",  # 119 s: Redis 42 s, RabbitMQ 77 s (its node starts twice)
    "tests/worker/faults/test_poison_item.py",  # 115 s
    "tests/engine/test_correctness.py",  # 93 s
    "tests/engine/test_tensor_parallel.py",  # 90 s
    "tests/infra/test_install.py",  # 80 s: a fresh venv, torch and the wheel installed
    "tests/engine/test_quantized_checkpoints.py",  # 75 s
    "tests/worker/faults/test_faults.py",  # 69 s
    "tests/engine/test_gguf.py",  # 69 s
    "tests/worker/broker/test_drain.py",  # 68 s
    "tests/worker/broker/test_broker_submission.py",  # 60 s
    "tests/kernels/test_gated_delta_compile.py",  # 60 s (262 s before it compiled the prefills in bf16 only)
    "tests/kernels/test_gpu_compile.py",  # 56 s
    "tests/worker/faults/test_storage_outage.py",  # 56 s (204 s with its 180 s outage)
    "tests/worker/faults/test_chaos.py",  # 55 s
    "tests/worker/faults/test_database_outage.py",  # 47 s
    "tests/worker/api/test_api.py",  # 47 s
    "tests/worker/api/test_cache_isolation.py",  # 46 s
    "tests/kernels/test_gated_delta_in_model.py",  # 44 s
    "tests/engine/test_quantized_kept_weights.py",  # 42 s
    "tests/engine/test_triton_backend.py",  # 40 s
    "tests/worker/faults/test_prefix_group_faults.py",  # 38 s
    "tests/engine/test_cuda_graphs.py",  # 38 s
    "tests/worker/broker/test_e2e.py",  # 36 s
    "tests/worker/entrypoints/test_docs_queued_example.py",  # 31 s
    "tests/kernels/test_quant_gemm.py",  # 30 s
    "tests/engine/test_qwen3_5.py",  # 28 s
    "tests/worker/broker/test_broker_lockdown.py",  # 28 s
    "tests/kernels/test_fused_moe.py",  # 28 s
    "tests/worker/broker/test_workers.py",  # 26 s
    "tests/worker/execution/test_cold_start.py",  # 26 s
    "tests/worker/entrypoints/test_progress.py",  # 26 s
)


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the named files first, in the list's order; the rest after,
    as collected. Within a file the order is unchanged (a stable sort)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
