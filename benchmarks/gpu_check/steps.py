"""The GPU check's steps, in order of what a short loan must prove first."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    argv: list[str]
    limit_s: float  # its own limit; the run's remaining budget may cut it shorter
    outputs: list[str] = field(default_factory=list)  # files it writes under the output directory


# The limits are sized for the GPU. A dry run is Triton's interpreter on a CPU that CI shares
# with other tests: a step may take several times longer there without anything being wrong.
DRY_RUN_SLACK = 5


def plan(out: Path, work: Path, *, dry_run: bool) -> list[Step]:
    """The steps, each a module of this repository run with this interpreter."""
    slack = DRY_RUN_SLACK if dry_run else 1
    py = [sys.executable, "-m"]
    dry = ["--dry-run"] if dry_run else []
    models = ["--models", str(work / "models")]
    return [
        Step(
            "kernel_shapes",
            "each kernel written since the first GPU run (gated delta, MLA decode, sinks, FP8 KV with "
            "per-head scales, W4A16/FP8-block/Q8_0/Q4_K GEMMs, MXFP4 and bf16 experts, W8A8) against its "
            "float32 reference at released models' shapes, timed",
            [*py, "benchmarks.gpu_check.kernel_shapes", "--out", str(out / "kernel_shapes.json"), *dry],
            limit_s=50 * slack,
            outputs=["kernel_shapes.json"],
        ),
        Step(
            "models",
            "bf16 teacher-forced logits at full width and two layers: Qwen3.5-9B, Qwen3.5-35B-A3B, "
            "gpt-oss-20b (MXFP4), DeepSeek-V2-Lite (MLA), Qwen3-8B FP8-block, Llama-3.1-8B Q4_K GGUF",
            [
                *py,
                "benchmarks.gpu_check.correctness",
                "--out",
                str(out / "models.json"),
                "--work",
                str(work),
                *models,
                *dry,
                "--workers",
                "3",
                "--test-timeout",
                "170",
                "--select",
                "tests/engine/test_bf16_logits_families.py",
            ],
            limit_s=180 * slack,
            outputs=["models.json"],
        ),
        Step(
            "correctness",
            "kernels in bf16/fp16 against their references, the triton backend and CUDA graphs against "
            "eager and transformers, bf16 teacher-forced logits at Qwen3-0.6B and Llama-3.1-8B shapes",
            [
                *py,
                "benchmarks.gpu_check.correctness",
                "--out",
                str(out / "correctness.json"),
                "--work",
                str(work),
                *models,
                *dry,
            ],
            limit_s=120 * slack,
            outputs=["correctness.json"],
        ),
        Step(
            "roofline",
            "decode steps against the bytes they must move (weights and KV) at batch 1/64/256 and context "
            "512/2048, as a fraction of the measured copy bandwidth; the attention kernel alone",
            [*py, "benchmarks.bench_decode_roofline", "--out", str(out / "roofline.json"), *models, *dry],
            limit_s=60 * slack,
            outputs=["roofline.json"],
        ),
        Step(
            "throughput",
            "nano-vllm's workload (Qwen3-0.6B shape, prompts and outputs 100-1024 tokens): our engine against "
            "transformers' static batched generate and its continuous batching, the same sequences for all",
            [
                *py,
                "benchmarks.bench_throughput",
                "--out",
                str(out / "throughput.json"),
                "--work",
                str(work),
                *models,
                *dry,
                # On the GPU, ours alone: the transformers baselines (13-14x slower on an H100,
                # benchmarks/results/gpu_h100_2026-11-26) take minutes this loan does not have.
                *([] if dry_run else ["--systems", "engine"]),
            ],
            limit_s=60 * slack,
            outputs=["throughput.json"],
        ),
        Step(
            "moe",
            "the fused MoE kernel against the token-sorted torch path, and replayed from a CUDA graph",
            [
                *py,
                "benchmarks.bench_moe",
                "--out",
                str(out / "moe.json"),
                *dry,
                *([] if dry_run else ["--shapes", "qwen3-moe", "mixtral", "--tokens", "1", "16", "256", "2048"]),
            ],
            limit_s=20 * slack,
            outputs=["moe.json"],
        ),
        Step(
            "cuda_graphs",
            "decode throughput with and without CUDA graphs, side by side",
            [
                *py,
                "benchmarks.bench_cuda_graphs",
                "--out",
                str(out / "cuda_graphs.json"),
                *dry,
                *([] if dry_run else ["--batches", "1", "64", "256", "--layers", "8", "--repeats", "2"]),
            ],
            limit_s=30 * slack,
            outputs=["cuda_graphs.json"],
        ),
    ]
