"""Gemma 4's largest model (31B, dense) at its published shape: KV bytes per token and the
tokens of cache that fit beside the weights on one or several 80 GB cards. Arithmetic from the
config's numbers (no download, no GPU); prints a table and writes
benchmarks/results/kv_capacity_gemma4.json.

Two cache layouts are counted: every layer keeping every token (what a paged cache that keeps
all blocks holds, as Conveyor's does for models mixing sliding and full layers), and sliding
layers keeping only their window (a cache with one block table per layer kind).

    python benchmarks/kv_capacity_gemma4.py
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks.common import write_results

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class Gemma4Shape:
    """google/gemma-4-31B's text_config (its published config.json)."""

    hidden_size: int = 5376
    num_layers: int = 60
    num_heads: int = 32
    intermediate_size: int = 21504
    vocab_size: int = 262144
    sliding_layers: int = 50  # layer_types: five sliding then one full, ten times
    full_layers: int = 10
    sliding_kv_heads: int = 16  # num_key_value_heads
    sliding_head_dim: int = 256  # head_dim
    full_kv_heads: int = 4  # num_global_key_value_heads
    full_head_dim: int = 512  # global_head_dim
    sliding_window: int = 1024
    attention_k_eq_v: bool = True  # full layers: no v_proj (V is read from the key projection)
    num_kv_shared_layers: int = 0
    max_position_embeddings: int = 262144

    def kv_bytes_per_token(self, elem: int = 2) -> dict[str, int]:
        # K and V are both cached even where attention_k_eq_v: V is the projection unnormed and
        # unrotated, K normed and rotated.
        sliding = 2 * self.sliding_kv_heads * self.sliding_head_dim * elem
        full = 2 * self.full_kv_heads * self.full_head_dim * elem
        return {
            "per_sliding_layer": sliding,
            "per_full_layer": full,
            "all_layers": self.sliding_layers * sliding + self.full_layers * full,
            "full_layers_only": self.full_layers * full,
        }

    def text_parameters(self) -> int:
        h, d_s, d_f = self.hidden_size, self.sliding_head_dim, self.full_head_dim
        sliding_attn = h * self.num_heads * d_s * 2 + h * self.sliding_kv_heads * d_s * 2  # q, o; k, v
        v_full = 0 if self.attention_k_eq_v else h * self.full_kv_heads * d_f
        full_attn = h * self.num_heads * d_f * 2 + h * self.full_kv_heads * d_f + v_full
        mlp = 3 * h * self.intermediate_size
        norms = 4 * h + 2 * max(d_s, d_f)
        layers = self.sliding_layers * (sliding_attn + mlp + norms) + self.full_layers * (full_attn + mlp + norms)
        return layers + self.vocab_size * h + h  # tied embeddings, final norm


def capacity(shape: Gemma4Shape, cards: int, *, card_bytes: int = 80 * GB, utilization: float = 0.9) -> dict:
    """Tokens of cache beside bf16 weights on ``cards`` cards (tensor parallel: weights and KV
    heads split), with the engine's default ``gpu_memory_utilization`` and 2 GiB per card kept
    for one step's activations."""
    weights = shape.text_parameters() * 2
    free = cards * (card_bytes * utilization - 2 * GIB) - weights
    kv = shape.kv_bytes_per_token()
    out = {"cards": cards, "weights_gb": weights / GB, "kv_budget_gb": max(free, 0) / GB}
    out["tokens_all_layers_kept"] = int(max(free, 0) // kv["all_layers"])
    # Sliding layers hold at most a window per sequence: the rest of the budget goes to full layers.
    for seqs in (1, 32):
        windows = seqs * shape.sliding_window * shape.sliding_layers * kv["per_sliding_layer"]
        out[f"tokens_windowed_{seqs}_seqs"] = int(max(free - windows, 0) // kv["full_layers_only"])
    return out


def main() -> None:
    shape = Gemma4Shape()
    kv = shape.kv_bytes_per_token()
    rows = [capacity(shape, n) for n in (1, 2, 4, 8)]
    params = shape.text_parameters()
    print(f"Gemma 4 31B (text): {params / 1e9:.2f}B parameters, {params * 2 / GB:.1f} GB in bf16")
    print(
        f"KV per token (bf16): sliding layer {kv['per_sliding_layer']} B, full layer {kv['per_full_layer']} B; "
        f"all 60 layers {kv['all_layers']} B ({kv['all_layers'] / 2**10:.0f} KiB), full layers only "
        f"{kv['full_layers_only']} B ({kv['full_layers_only'] / 2**10:.0f} KiB)"
    )
    header = ("cards", "KV budget GB", "tokens, all kept", "windowed, 1 seq", "windowed, 32 seqs")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 12, 17, 16, 18), strict=True)))
    for r in rows:
        print(
            f"{r['cards']:>5} {r['kv_budget_gb']:>12.1f} {r['tokens_all_layers_kept']:>17,} "
            f"{r['tokens_windowed_1_seqs']:>16,} {r['tokens_windowed_32_seqs']:>18,}"
        )
    write_results("kv_capacity_gemma4.json", {"shape": asdict(shape), "kv_bytes_per_token": kv, "capacity": rows})


if __name__ == "__main__":
    main()
