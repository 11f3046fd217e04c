"""gpt-oss as released: its experts in MXFP4 (``*_blocks``/``*_scales``), the rest bfloat16 in
sharded files, config.json in the release's spelling. Loaded through ``conveyor.engine.quantization``,
it answers greedy token for token as transformers does on the same checkpoint, dequantized by
transformers' own MXFP4 loader (float32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine import quantized_checkpoints as qc
from tests.engine.reference import assert_outputs_match, greedy, oracle_model

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours", "Tea", "A"]
MAX_TOKENS = [16, 9, 20, 12]


@pytest.fixture(scope="module")
def released(tiny_models, tmp_path_factory) -> str:
    return str(qc.write_released_gpt_oss(tiny_models("gpt_oss"), tmp_path_factory.mktemp("gpt_oss") / "released"))


def test_transformers_dequantizes_the_blocks_we_wrote(released, tiny_models):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ours = {}
    for file in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        ours.update(load_file(f"{released}/{file}"))
    theirs = dict(oracle_model(released).named_parameters())
    original = load_file(f"{tiny_models('gpt_oss')}/model.safetensors")
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        expected = convert_moe_packed_tensors(ours[name + "_blocks"], ours[name + "_scales"], dtype=torch.float32)
        assert torch.equal(theirs[name], expected), name  # the oracle runs the MXFP4 weights...
        assert not torch.equal(theirs[name], original[name]), name  # ...not the float ones they came from
        # (the packing keeps each weight within half a step of e2m1 at its group's scale)
        assert torch.allclose(theirs[name], original[name], atol=0.5, rtol=0.25), name


def test_released_checkpoint_matches_transformers(released, hf_reference, make_llm):
    config = json.loads(Path(released, "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    outs = make_llm(released).generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(released), PROMPTS, MAX_TOKENS, outs)


def test_preemption_chunked_prefill_and_prefix_caching(released, hf_reference, make_llm):
    hf = hf_reference(released)
    max_tokens = [m + 16 for m in MAX_TOKENS]
    llm = make_llm(released, block_size=4, num_kv_blocks=12, max_num_batched_tokens=6)
    assert_outputs_match(hf, PROMPTS, max_tokens, llm.generate(PROMPTS, greedy(max_tokens)))
    assert llm.engine.stats().num_preemptions > 0
    llm = make_llm(released, block_size=4)
    llm.generate(PROMPTS, greedy(MAX_TOKENS))
    again = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_outputs_match(hf, PROMPTS, MAX_TOKENS, again)


def test_two_ranks_split_the_dequantized_experts(released, hf_reference, make_llm):
    # Each rank dequantizes an expert tensor and keeps its slice of the interleaved gate/up columns.
    llm = make_llm(released, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16)
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    finally:
        llm.shutdown()
    assert_outputs_match(hf_reference(released), PROMPTS, MAX_TOKENS, outs)


def test_a_hub_download_skips_the_copies_in_other_formats(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from conveyor.engine.models.loader import resolve_model_path

    asked = {}

    def snapshot_download(**kwargs):
        asked.update(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    resolve_model_path("openai/gpt-oss-20b")
    # openai/gpt-oss-20b's files (the released repository's listing, abridged)
    files = [
        *("config.json", "generation_config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"),
        *("special_tokens_map.json", "model.safetensors.index.json", "model-00000-of-00002.safetensors"),
        *("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "original/config.json"),
        *("original/dtypes.json", "original/model.safetensors", "metal/model.bin", "LICENSE", "README.md"),
    ]
    patterns = {"allow_patterns": asked["allow_patterns"], "ignore_patterns": asked["ignore_patterns"]}
    assert list(filter_repo_objects(files, **patterns)) == files[:10]
    # (a sentence-transformers checkpoint's pooling folder is still fetched)
    assert list(filter_repo_objects(["1_Pooling/config.json"], **patterns)) == ["1_Pooling/config.json"]


def test_experts_kept_in_mxfp4_on_the_fused_kernel(released, hf_reference, make_llm, monkeypatch):
    """Where the fused kernel runs (here forced, in Triton's interpreter), the experts stay in
    MXFP4, decoded inside the kernel's K loop: 4.25 bits a weight instead of a float copy, and
    transformers' tokens from its own MXFP4 loader."""
    from conveyor.engine.models.gpt_oss import GptOssExperts
    from conveyor.engine.models.moe import SparseMoE
    from conveyor.engine.quantization import kept

    monkeypatch.setattr(kept, "KEEP_ON_CPU", True)
    monkeypatch.setattr(SparseMoE, "use_fused_kernel", True)
    # The experts never exist as floats while loading: built on the meta device, each taken as
    # its MXFP4 blocks (gpt-oss-120b's bf16 experts would need four cards just to be built).
    taken: list[tuple[bool, bool]] = []
    take = kept.KeptWeights.take

    def watched_take(self, target, offset, rows, read, shard):
        dense = take(self, target, offset, rows, read, shard)
        if id(target) in self.expert_places:
            taken.append((target.is_meta, dense is None))
        return dense

    monkeypatch.setattr(kept.KeptWeights, "take", watched_take)
    llm = make_llm(released, dtype="float32", attention_backend="triton")
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, GptOssExperts)]
    assert taken and taken == [(True, True)] * len(taken) and len(taken) == 2 * len(experts)
    weights = [w for m in experts for w in (m.gate_up, m.down) if isinstance(w, kept.KeptExpertsWeight)]
    assert experts and len(weights) == 2 * len(experts)
    assert not any(isinstance(p, kept.KeptExpertsWeight) for p in llm.engine.runner.model.parameters())
    params = sum(w.numel() for w in weights)
    held = sum(w.kernel.blocks.numel() + w.kernel.scales.numel() for w in weights)  # uint8: one byte each
    assert held / params == 17 / 32  # ~0.53 bytes a weight, against 2 in bf16 (4 in float32)
    prompts, max_tokens = PROMPTS[:2], [8, 6]
    outs = llm.generate(prompts, greedy(max_tokens))
    assert_outputs_match(hf_reference(released), prompts, max_tokens, outs)
