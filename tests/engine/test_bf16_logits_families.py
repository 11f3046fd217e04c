"""Engine logits in bf16 against transformers' float32, teacher-forced (``test_bf16_logits``'s
mechanism), at released models' full widths and two layers: the hybrid and MoE-hybrid Qwen3.5,
gpt-oss's MXFP4 experts with sinks and YaRN, DeepSeek-V2-Lite's MLA, Qwen3-8B in FP8 blocks and
Llama-3.1-8B as Q4_K GGUF (the oracle runs the float weights each format stores).

A GPU check step (``benchmarks.gpu_check``'s ``models``); its dry run
(``CONVEYOR_GPU_CHECK_DRY_RUN=1``) runs the same families and formats at a tiny width on CPU.
Skipped otherwise: full widths need a GPU."""

from __future__ import annotations

import os
import random
from dataclasses import asdict
from functools import partial
from pathlib import Path

import pytest

from conveyor.kernels.interpreter import kernel_device
from tests.engine.family_shapes import FAMILY_SHAPES, build_family, missing_in_transformers
from tests.engine.quantized_checkpoints import quantize_activations
from tests.engine.test_bf16_logits import NEW_TOKENS, teacher_forced_errors

ON_GPU = kernel_device() == "cuda"
DRY_RUN = os.environ.get("CONVEYOR_GPU_CHECK_DRY_RUN") == "1"


@pytest.mark.parametrize("name", list(FAMILY_SHAPES))
def test_bf16_logits_of_released_families(name, tmp_path_factory, make_llm, record_property):
    if not ON_GPU and not DRY_RUN:
        pytest.skip("full-width model shapes need a GPU (CONVEYOR_TEST_GPU=1)")
    reason = missing_in_transformers(name)
    if reason:
        pytest.skip(reason)
    root = Path(os.environ.get("CONVEYOR_SHAPED_MODELS") or tmp_path_factory.mktemp("families"))
    ours_path, oracle_path, oracle_kwargs = build_family(root, name, dry_run=not ON_GPU)
    shape = FAMILY_SHAPES[name]
    llm = make_llm(
        ours_path, dtype="bfloat16", device=kernel_device(), max_num_seqs=4, max_model_len=1024, **shape.engine
    )
    if ON_GPU:
        assert llm.engine.runner.backend.name == "triton"
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    # Past gpt-oss's window of 128 and over several KV blocks.
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 40, 300)]
    prepare = None
    if shape.fmt == "fp8-block":  # W8A8: the oracle's layers quantize their inputs as the format says
        prepare = partial(quantize_activations, quantized_dir=Path(ours_path))
    errors = teacher_forced_errors(oracle_path, llm, prompts, NEW_TOKENS, prepare, **oracle_kwargs)
    record_property("format", shape.fmt)
    for key, value in asdict(errors).items():
        record_property(key, value)  # the GPU check reports these figures
    if ON_GPU:
        errors.assert_as_close_as_transformers_own()
    # The dry run proves the path and records its figures; at the tiny width gpt-oss (mean 2.5x
    # transformers' own, max 10x) and Qwen3-8B's FP8 blocks (37 flips in 72) are off, not yet explained.
