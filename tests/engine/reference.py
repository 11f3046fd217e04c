"""Transformers' own greedy generation as the oracle, with the near-tie rule.

Two float32 implementations of the same model differ in the last bits of their logits
(different matmul blocking, batch shapes). A greedy token can therefore only legitimately
differ where the reference's top-two logits are within ``TIE_MARGIN``; after such a point the
two continuations are different texts and are not compared further.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.engine import SamplingParams

TIE_MARGIN = 1e-3
# References are generated once per prompt at this length and cut: greedy output for a
# smaller max_new_tokens is a prefix of it.
REFERENCE_TOKENS = 80


@dataclass
class Greedy:
    token_ids: list[int]
    margins: list[float]  # top1 - top2 logit at each generated position
    logits: list[torch.Tensor]


def oracle_model(path: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Any:
    """Transformers' model of ``path`` as the oracle: with its eager attention, the one every
    release computes in full. Its SDPA path drops Gemma 2's attention soft cap in some releases
    (5.17 runs it; 5.24 refuses SDPA for Gemma 2), which made a correct engine look wrong on the
    lent GPU. (Its type, the one with ``generate``, is private.)"""
    kwargs = {**_dequantized_mxfp4(path), **kwargs}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kwargs).eval()


def _dequantized_mxfp4(path: str) -> dict[str, Any]:
    """An MXFP4 checkpoint's oracle runs its experts dequantized. With Hugging Face's
    ``kernels`` installed (transformers 5.25 requires it) transformers would instead fetch a
    Triton kernel from the hub, which tests cannot reach; dequantized is what it ran before, the
    same MXFP4 values in float."""
    config = Path(path) / "config.json"
    quantization = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if not quantization or quantization.get("quant_method") != "mxfp4":
        return {}
    from transformers.utils.quantization_config import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


class HFReference:
    def __init__(self, path: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = oracle_model(path)
        self._cache: dict[tuple, Greedy] = {}

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, **gen_kwargs) -> Greedy:
        full = self._greedy(prompt_ids, max(max_new_tokens, REFERENCE_TOKENS), **gen_kwargs)
        m = max_new_tokens
        return Greedy(full.token_ids[:m], full.margins[:m], full.logits[:m])

    def _greedy(self, prompt_ids: list[int], max_new_tokens: int, **gen_kwargs) -> Greedy:
        key = (tuple(prompt_ids), max_new_tokens, tuple(sorted(gen_kwargs.items())))
        if key not in self._cache:
            ids = torch.tensor([prompt_ids])
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=self.tokenizer.pad_token_id,
                **gen_kwargs,
            )
            tokens = out.sequences[0, len(prompt_ids) :].tolist()
            logits = [step[0].float() for step in out.logits]
            # Margins of the processed scores: what greedy decoding actually compared.
            margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
            self._cache[key] = Greedy(tokens, margins, logits)
        return self._cache[key]


def assert_greedy_match(ours: list[int], ref: Greedy, label: str = "") -> None:
    for i, (a, b) in enumerate(zip(ours, ref.token_ids, strict=False)):  # lengths compared below
        if a != b:
            assert ref.margins[i] < TIE_MARGIN, (
                f"{label}: token {i} is {a}, transformers gives {b} with a logit margin of "
                f"{ref.margins[i]:.2e} (not a near-tie)\nours: {ours}\nref:  {ref.token_ids}"
            )
            return
    assert len(ours) == len(ref.token_ids), f"{label}: {len(ours)} tokens, transformers gives {len(ref.token_ids)}"


def assert_outputs_match(hf: HFReference, prompts: list[str], max_tokens: list[int], outs: list) -> None:
    """Each output finished, with the prompt ids transformers encodes and its greedy tokens
    (near-ties aside). ``outs`` are ``RequestOutput``s in prompt order."""
    assert len(outs) == len(prompts) == len(max_tokens)
    for prompt, m, out in zip(prompts, max_tokens, outs, strict=True):
        ids = hf.encode(prompt)
        assert out.finished and out.prompt_token_ids == ids
        assert_greedy_match(out.token_ids, hf.greedy(ids, m), label=repr(prompt))


def greedy(max_tokens: list[int], **kwargs) -> list[SamplingParams]:
    """Greedy sampling parameters, one per request."""
    return [SamplingParams(max_tokens=m, temperature=0.0, **kwargs) for m in max_tokens]
