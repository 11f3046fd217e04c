"""GLM-4.5 MoE (``glm4_moe``): its grouped sigmoid routing against transformers' router, the
multi-token-prediction layers skipped at load, ngram speculation over it. (Greedy tokens
against transformers in the engine's conditions are in test_correctness.py and
test_prefix_caching.py, bf16 logits in test_bf16_logits.py, two ranks in test_tensor_parallel.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine.models.grouped_sigmoid_moe import GroupedSigmoidMoE
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.moe import SparseMoE, grouped_sigmoid_route
from conveyor.kernels.interpreter import kernel_device
from tests.engine.reference import assert_outputs_match, greedy

PROMPTS = [
    "The chef will bring the soup to the table",
    "Seven eight nine ten, seven eight nine ten, seven eight",
    "Tip the waiter",
]
MAX_TOKENS = [30, 24, 16]


@pytest.mark.parametrize(
    ("groups", "topk_group", "norm_topk_prob"),
    [(1, 1, True), (4, 2, True), (4, 1, False), (8, 3, True)],
    ids=["one-group", "two-of-four-groups", "one-of-four-unnormalised", "three-of-eight-groups"],
)
def test_routing_matches_transformers_router(groups, topk_group, norm_topk_prob):
    """The experts and weights of ``grouped_sigmoid_route``, from the ``MoESpec`` our config
    reader builds, are transformers' router's, for many tokens with a large score bias."""
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = transformers.Glm4MoeConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=8,
        n_group=groups,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
        first_k_dense_replace=2,
    )
    spec = ModelSpec.from_dicts({**config.to_dict(), "architectures": ["Glm4MoeForCausalLM"]})
    moe = spec.moe
    assert moe is not None and moe.sparse_layers == (2,) and (moe.n_group, moe.topk_group) == (groups, topk_group)
    router = Glm4MoeTopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5, generator=gen)
        router.e_score_correction_bias.normal_(0.0, 0.5, generator=gen)
    x = torch.randn(64, 16, generator=gen)
    _, ref_weights, ref_ids = router(x)
    weights, ids = grouped_sigmoid_route(x @ router.weight.detach().T, router.e_score_correction_bias, moe)
    ours, theirs = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    torch.testing.assert_close(ours.values, theirs.values)
    torch.testing.assert_close(weights.gather(1, ours.indices), ref_weights.detach().gather(1, theirs.indices))
    if groups > 1:  # every token's experts lie in its topk_group groups
        per_group = 16 // groups
        assert all(len(set((row // per_group).tolist())) <= topk_group for row in ids)


def test_config_without_enough_experts_per_group_is_refused():
    cfg = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_hidden_layers": 2}
    cfg.update(n_routed_experts=8, n_group=8, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="n_group 8 groups of 2 or more"):
        ModelSpec.from_dicts(
            {**cfg, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
        )


def test_multi_token_prediction_layers_are_skipped(tiny_models, hf_reference, make_llm, tmp_path):
    """A real checkpoint stores its MTP layer after the decoder's (``model.layers.<N>``); it
    loads, unused, and the tokens stay transformers'. A stray tensor elsewhere is still refused."""
    path = Path(tiny_models("glm4_moe"))
    copy = Path(shutil.copytree(path, tmp_path / "with-mtp"))
    weights = load_file(str(copy / "model.safetensors"))
    layers = ModelSpec.from_pretrained(path).num_layers
    weights[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    weights[f"model.layers.{layers}.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    llm = make_llm(str(copy))
    assert (
        sum(isinstance(m, GroupedSigmoidMoE) for m in llm.engine.runner.model.modules()) == layers - 1
    )  # layer 0 dense
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert_outputs_match(hf_reference(str(path)), PROMPTS, MAX_TOKENS, outs)
    weights["model.layers.0.mlp.stray.weight"] = torch.zeros(4, 4)
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.stray\.weight'"):
        make_llm(str(copy))


def test_ngram_speculation_is_exact(tiny_models, hf_reference, make_llm):
    path = tiny_models("glm4_moe", init_std=0.02)  # (a small init: the model repeats itself, proposals land)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = make_llm(path, block_size=4, max_num_batched_tokens=24, speculative_config=spec)
    outs = llm.generate(PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    assert_outputs_match(hf_reference(path), PROMPTS, MAX_TOKENS, outs)
    stats = llm.engine.stats().spec_decode
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_proposed_tokens


def test_fused_kernel_path_matches_transformers(tiny_models, hf_reference, make_llm, monkeypatch):
    """The experts on the fused Triton kernel (the interpreter on CPU), weighed in float32."""
    pytest.importorskip("triton")
    monkeypatch.setattr(SparseMoE, "use_fused_kernel", True)
    path = tiny_models("glm4_moe")
    llm = make_llm(path, device=kernel_device(), enforce_eager=True)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, GroupedSigmoidMoE)]
    assert blocks and all(b.fused for b in blocks)
    outs = llm.generate(PROMPTS[:2], greedy([9, 5]))
    assert_outputs_match(hf_reference(path), PROMPTS[:2], [9, 5], outs)
