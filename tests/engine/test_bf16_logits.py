"""Engine logits in bfloat16 against transformers, teacher-forced.

Greedy texts cannot be compared in bf16: two correct implementations round differently and
part at the first near-tie. So the engine is fed a fixed continuation (transformers' own
float32 greedy one) and its logits at every step are compared with transformers' float32
logits of the same sequence. The tolerance is transformers' own: the engine's bf16 error
must be of the size of the error transformers makes in bf16 on the same sequences.

On CPU this runs the ``torch`` backend (the Triton interpreter cannot compute in bf16); with
``CONVEYOR_TEST_GPU=1`` on a GPU, the ``triton`` backend with CUDA graphs.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.engine import SamplingParams
from conveyor.engine.sample.sampler import SamplerOutput
from conveyor.kernels.interpreter import kernel_device
from conveyor.testing.tiny_models import build_shaped_model, shaped_model_dir
from tests.engine.helpers import model_case
from tests.engine.reference import oracle_model

DEVICE = kernel_device()
ON_GPU = DEVICE == "cuda"
PROMPTS = [
    "The chef will bring",
    "Seven guests wait at the table and the waiter pours cold water while the kitchen",
    "Tea",
    "Late guests ask the waiter about the menu, the bill, the tip and the sweet cake.",
]
NEW_TOKENS = 24


class TeacherSampler:
    """Records each step's logits and answers with the forced continuation's next token."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.logits: dict[tuple[int, ...], list[torch.Tensor]] = {k: [] for k in continuations}

    def __call__(self, logits: torch.Tensor, reqs) -> SamplerOutput:
        tokens = []
        for row, req in zip(logits.float().cpu(), reqs, strict=True):
            key = tuple(req.prompt_token_ids)
            self.logits[key].append(row)
            tokens.append(self.continuations[key][len(req.output_token_ids)])
        return SamplerOutput(tokens, None)


def _hf_logits(model, ids: list[int], n: int) -> torch.Tensor:
    """Logits predicting each of the last ``n`` tokens of ``ids`` (and the one after)."""
    with torch.no_grad():
        out = model(torch.tensor([ids], device=DEVICE)).logits[0].float().cpu()
    return out[len(ids) - n - 1 : len(ids) - 1]


def _hf_model(path: str, dtype: torch.dtype, **kwargs: Any) -> Any:
    """Transformers' model of ``path`` on DEVICE, as the oracle (eager attention)."""
    return oracle_model(path, dtype, **kwargs).to(DEVICE)


@dataclass
class LogitErrors:
    """The engine's bf16 logits and transformers' bf16 logits, each against transformers' float32."""

    ours_mean: float
    ours_max: float
    hf_mean: float
    hf_max: float
    flips: int  # top-1 disagreements where the float32 margin is wider than bf16 noise
    positions: int

    def summary(self) -> str:
        return (
            f"mean |err| ours {self.ours_mean:.4f} vs transformers bf16 {self.hf_mean:.4f}; "
            f"max {self.ours_max:.4f} vs {self.hf_max:.4f}; {self.flips} flips in {self.positions} positions"
        )

    def assert_as_close_as_transformers_own(self) -> None:
        assert self.ours_mean <= 1.5 * max(self.hf_mean, 1e-6), self.summary()
        assert self.ours_max <= 2.0 * self.hf_max, self.summary()
        assert self.flips == 0, self.summary()
        # and bf16 really is being tested: an error well above float32's
        assert self.hf_mean > 1e-3, self.summary()


def teacher_forced_errors(
    path: str,
    llm,
    prompts: list[list[int]],
    new_tokens: int,
    prepare_oracle: Callable[[Any], Any] | None = None,
    **hf_kwargs: Any,
) -> LogitErrors:
    """Feed the engine transformers' float32 greedy continuation of each prompt and compare
    its logits at every step with transformers' float32 and bf16 logits of the same sequence
    (``hf_kwargs``: for transformers' ``from_pretrained``, e.g. a GGUF file's name;
    ``prepare_oracle``: what the format does beside its weights, applied to both oracles, e.g.
    a W8A8 format's layers quantizing their inputs)."""
    prepare = prepare_oracle or (lambda model: model)
    hf32 = prepare(_hf_model(path, torch.float32, **hf_kwargs))
    continuations = {}
    for ids in prompts:
        x = torch.tensor([ids], device=DEVICE)
        with torch.no_grad():
            out = hf32.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        continuations[tuple(ids)] = out[0, len(ids) :].tolist()
    teacher = TeacherSampler(continuations)
    llm.engine.runner.sampler = teacher
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    fulls = {key: list(key) + continuations[key] for key in continuations}
    refs = {key: _hf_logits(hf32, full, new_tokens) for key, full in fulls.items()}
    del hf32
    hf16 = prepare(_hf_model(path, torch.bfloat16, **hf_kwargs))
    ours_errs: list[torch.Tensor] = []
    hf_errs: list[torch.Tensor] = []
    flips = 0
    for out in outs:
        key = tuple(out.prompt_token_ids)
        assert out.token_ids == continuations[key]  # the engine followed the teacher
        ref = refs[key]
        hf_bf16 = _hf_logits(hf16, fulls[key], new_tokens)
        ours = torch.stack(teacher.logits[key])
        assert ours.shape == ref.shape
        ours_errs.append((ours - ref).abs())
        hf_errs.append((hf_bf16 - ref).abs())
        top2 = ref.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 4 * hf_errs[-1].max(dim=-1).values
        flips += int((ours.argmax(-1) != ref.argmax(-1))[clear].sum())
    ours_err, hf_err = torch.cat(ours_errs), torch.cat(hf_errs)
    return LogitErrors(
        ours_mean=float(ours_err.mean()),
        ours_max=float(ours_err.max()),
        hf_mean=float(hf_err.mean()),
        hf_max=float(hf_err.max()),
        flips=flips,
        positions=int(ours_err.shape[0]),
    )


@pytest.mark.parametrize(
    "family",
    [
        *("llama", "qwen3", "gemma2", "gemma3", "glm4_moe", "gemma4", "gpt_oss", "smollm3", "olmo3"),
        *("deepseek_v3-bf16", "qwen3_5", "qwen3_5_moe"),
    ],
)
def test_bf16_logits_are_as_close_as_transformers_own(tiny_models, make_llm, family):
    path, kwargs = model_case(tiny_models, family)
    llm = make_llm(path, dtype="bfloat16", device=DEVICE, max_num_seqs=4, **kwargs)
    if ON_GPU:
        # Decode runs from CUDA graphs wherever the model can be captured; DeepSeek-V3's MLA
        # and Gemma 4's per-kind caches say they cannot, and run eagerly (the first H200 run
        # found this test asking graphs of them).
        runner = llm.engine.runner
        assert runner.backend.name == "triton"
        assert (runner.graphs is not None) == runner.model.supports_cuda_graphs, family
    tok = llm.get_tokenizer()
    prompts = [tok(prompt).input_ids for prompt in PROMPTS]
    teacher_forced_errors(path, llm, prompts, NEW_TOKENS).assert_as_close_as_transformers_own()


# Released models' shapes with random weights (``conveyor.testing.tiny_models.REAL_SHAPES``): Qwen3-0.6B
# whole, Llama-3.1-8B at 4 of its 32 layers (every width, the 128k vocabulary and llama3 RoPE
# kept; the layers repeat the same shapes). Full width needs a GPU; the GPU check's dry run
# (``CONVEYOR_GPU_CHECK_DRY_RUN=1``) runs the same code on the families at a tiny width.
REAL_SHAPE_LAYERS = {"qwen3-0.6b": None, "llama-3.1-8b": 4}
DRY_RUN = os.environ.get("CONVEYOR_GPU_CHECK_DRY_RUN") == "1"


@pytest.mark.parametrize("shape", sorted(REAL_SHAPE_LAYERS))
def test_bf16_logits_at_real_model_shapes(shape, tmp_path_factory, make_llm, record_property):
    if not ON_GPU and not DRY_RUN:
        pytest.skip("full-width model shapes need a GPU (CONVEYOR_TEST_GPU=1)")
    # The GPU check builds each checkpoint once for all its steps (CONVEYOR_SHAPED_MODELS).
    root = Path(os.environ.get("CONVEYOR_SHAPED_MODELS") or tmp_path_factory.mktemp("shaped"))
    layers = REAL_SHAPE_LAYERS[shape]
    where = shaped_model_dir(root, shape, layers, dry_run=not ON_GPU)
    path = str(build_shaped_model(where, shape, num_layers=layers, dry_run=not ON_GPU))
    llm = make_llm(path, dtype="bfloat16", device=DEVICE, max_num_seqs=4, max_model_len=1024)
    if ON_GPU:
        assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.graphs is not None
    # Token ids from the whole vocabulary; lengths that span one and many KV blocks, and a long
    # one whose decode splits its keys.
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 33, 160, 700)]
    errors = teacher_forced_errors(path, llm, prompts, NEW_TOKENS)
    for key, value in asdict(errors).items():
        record_property(key, value)  # the GPU check reports these figures
    errors.assert_as_close_as_transformers_own()
