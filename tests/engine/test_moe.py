"""The token-sorted MoE path against a per-token reference, and the routing against
transformers' own routers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.models.moe import moe_naive, moe_sorted, route

E, H, INTER, T = 6, 16, 8, 11


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.3
    w2 = torch.randn(E, H, INTER, generator=g) * 0.3
    return x, w13, w2


def _random_route(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    return route(logits, k, renormalize=True, weight_dtype=torch.float32)


def _check(x, w13, w2, weights, ids) -> None:
    torch.testing.assert_close(moe_sorted(x, w13, w2, weights, ids), moe_naive(x, w13, w2, weights, ids))


@pytest.mark.parametrize("k", [1, 2])
def test_sorted_path_matches_per_token_reference(k):
    x, w13, w2 = _weights()
    weights, ids = _random_route(k, seed=k)
    _check(x, w13, w2, weights, ids)


@pytest.mark.parametrize("k", [1, 2])
def test_experts_with_no_tokens_are_skipped(k):
    """Only experts 1 and 4 get tokens (0, 2, 3, 5 none, including the first and last)."""
    x, w13, w2 = _weights()
    ids = torch.tensor([[1, 4][(t + j) % 2] for t in range(T) for j in range(k)]).view(T, k)
    weights = torch.rand(T, k)
    _check(x, w13, w2, weights, ids)
    # Changing an unused expert's weights changes nothing.
    w13b = w13.clone()
    w13b[0] += 1.0
    torch.testing.assert_close(moe_sorted(x, w13b, w2, weights, ids), moe_sorted(x, w13, w2, weights, ids))


def test_all_tokens_on_one_expert():
    x, w13, w2 = _weights()
    ids = torch.full((T, 1), 3)
    weights = torch.ones(T, 1)
    out = moe_sorted(x, w13, w2, weights, ids)
    _check(x, w13, w2, weights, ids)
    # With weight 1 that is exactly expert 3's MLP over the batch.
    gate, up = (x @ w13[3].T).chunk(2, dim=-1)
    torch.testing.assert_close(out, (torch.nn.functional.silu(gate) * up) @ w2[3].T)


def test_one_token_and_k_equal_to_all_experts():
    x, w13, w2 = _weights()
    weights, ids = _random_route(E, seed=3)
    _check(x, w13, w2, weights, ids)
    _check(x[:1], w13, w2, weights[:1], ids[:1])


def test_bf16_accumulates_in_the_activation_dtype():
    x, w13, w2 = (t.to(torch.bfloat16) for t in _weights())
    weights, ids = _random_route(2, seed=5)
    out = moe_sorted(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, moe_naive(x, w13, w2, weights, ids), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(
    ("family", "norm_topk_prob"),
    [("mixtral", True), ("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", False), ("qwen3_moe", True)],
)
def test_routing_matches_transformers_router(family, norm_topk_prob):
    """Our ``route`` (as ``SparseMoE`` calls it, from the ``MoESpec`` our config reader
    builds) gives transformers' router's weights and experts."""
    import transformers

    common: dict[str, Any] = dict(vocab_size=32, hidden_size=H, num_hidden_layers=1)
    common.update(num_attention_heads=2, num_key_value_heads=1)
    config: Any
    if family == "mixtral":  # (which always renormalises)
        config = transformers.MixtralConfig(
            num_local_experts=E, num_experts_per_tok=2, intermediate_size=INTER, **common
        )
        router_cls = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter
    else:
        cls = transformers.Qwen2MoeConfig if family == "qwen2_moe" else transformers.Qwen3MoeConfig
        config = cls(
            num_experts=E, num_experts_per_tok=2, moe_intermediate_size=INTER, norm_topk_prob=norm_topk_prob, **common
        )
        module = getattr(transformers.models, family)
        router_cls = getattr(getattr(module, f"modeling_{family}"), f"{config.__class__.__name__[:-6]}TopKRouter")
    spec = ModelSpec.from_dicts({**config.to_dict(), "architectures": [f"{config.__class__.__name__[:-6]}ForCausalLM"]})
    moe = spec.moe
    assert moe is not None and moe.num_experts == E and moe.sparse_layers == (0,)
    router = router_cls(config)
    torch.nn.init.normal_(router.weight, std=1.0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    _, ref_weights, ref_ids = router(x)
    weights, ids = route(
        x @ router.weight.detach().T, moe.top_k, moe.renormalize, torch.float32 if moe.fp32_weights else x.dtype
    )
    torch.testing.assert_close(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.detach())
    assert torch.allclose(weights.sum(-1), torch.ones(T)) == (family == "mixtral" or norm_topk_prob)
