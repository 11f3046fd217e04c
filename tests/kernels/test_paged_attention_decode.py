"""Triton paged attention vs the reference: decode-heavy batches (see _attention_cases)."""

from ._attention_cases import parametrize, run_case


@parametrize(["decode", "shared_prefix", "mixed"])
def test_paged_attention_decode_like(scenario, group, head_dim, dtype, variant):
    run_case(scenario, group, head_dim, dtype, variant)
