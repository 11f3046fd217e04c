"""Triton paged attention vs the reference: prefill and prefill over a cached prefix."""

from ._attention_cases import parametrize, run_case


@parametrize(["prefill", "extend"])
def test_paged_attention_prefill_like(scenario, group, head_dim, dtype, variant):
    run_case(scenario, group, head_dim, dtype, variant)
