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

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.sampler import SamplerOutput
from kernels.interpreter import kernel_device

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


def _hf_model(path: str, dtype: torch.dtype) -> Any:
    """Transformers' model of ``path`` on DEVICE (its type, the one with ``generate``, is private)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(DEVICE).eval()  # type: ignore[arg-type]  # stubs lose .to's self: wrapped by functools.wraps


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])
def test_bf16_logits_are_as_close_as_transformers_own(tiny_models, make_llm, family):
    path = tiny_models(family)
    hf32, hf16 = _hf_model(path, torch.float32), _hf_model(path, torch.bfloat16)
    llm = make_llm(path, dtype="bfloat16", device=DEVICE, max_num_seqs=4)
    if ON_GPU:
        assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.graphs is not None
    tok = llm.get_tokenizer()

    continuations = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids], device=DEVICE)
        with torch.no_grad():
            out = hf32.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        continuations[tuple(ids[0].tolist())] = out[0, ids.shape[1] :].tolist()
    teacher = TeacherSampler(continuations)
    llm.engine.runner.sampler = teacher
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))

    ours_errs: list[torch.Tensor] = []
    hf_errs: list[torch.Tensor] = []
    flips = 0
    for out in outs:
        key = tuple(out.prompt_token_ids)
        assert out.token_ids == continuations[key]  # the engine followed the teacher
        full = list(key) + continuations[key]
        ref = _hf_logits(hf32, full, NEW_TOKENS)
        hf_bf16 = _hf_logits(hf16, full, NEW_TOKENS)
        ours = torch.stack(teacher.logits[key])
        assert ours.shape == ref.shape
        ours_errs.append((ours - ref).abs())
        hf_errs.append((hf_bf16 - ref).abs())
        # Top-1 agrees wherever the float32 margin is wider than bf16 noise.
        top2 = ref.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 4 * hf_errs[-1].max(dim=-1).values
        flips += int((ours.argmax(-1) != ref.argmax(-1))[clear].sum())
    ours_err, hf_err = torch.cat(ours_errs), torch.cat(hf_errs)
    scale = max(float(hf_err.mean()), 1e-6)
    summary = (
        f"mean |err| ours {float(ours_err.mean()):.4f} vs transformers bf16 {float(hf_err.mean()):.4f}; "
        f"max {float(ours_err.max()):.4f} vs {float(hf_err.max()):.4f}"
    )
    assert float(ours_err.mean()) <= 1.5 * scale, summary
    assert float(ours_err.max()) <= 2.0 * float(hf_err.max()), summary
    assert flips == 0, summary
    # and bf16 really is being tested: an error well above float32's
    assert float(hf_err.mean()) > 1e-3, summary
