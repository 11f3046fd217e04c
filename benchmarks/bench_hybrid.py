"""Hybrid models (Qwen3.5): the memory a request costs and the concurrency that follows, and
CPU decode throughput against transformers.

Memory, from published config numbers (no download): Qwen3.5-9B's text model (32 layers, 8 of
them full attention with 4 KV heads of 256; 24 gated DeltaNet layers with 32 value heads of
128 x 128 state and a 4-tap conv over 8192 channels) against Qwen3-8B (36 layers, 8 KV heads of
128), both bf16. A request costs KV bytes per token of context plus (Qwen3.5) one state slot;
concurrency is how many requests of a given context fit in what an 80 GB card has left after
the weights at ``gpu_memory_utilization`` 0.9 (activations and the CUDA context left out:
the same for both).

Throughput: the tiny random-weight Qwen3.5 checkpoint (``conveyor.testing.tiny_models``), float32 on CPU,
greedy decode of one sequence in our engine and in transformers' ``generate``, and a batch of
8 in the engine. Writes benchmarks/results/hybrid.json.

    python benchmarks/bench_hybrid.py [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import machine_info, write_results
from conveyor.engine.models.model_config import ModelSpec

GIB = 2**30
CARD_BYTES = 80 * 10**9
UTILIZATION = 0.9
QWEN3_5_9B = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
}
QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000},
}


def _weights_bytes(spec: ModelSpec) -> int:
    from conveyor.engine.models.registry import model_class

    with torch.device("meta"):
        model = model_class(spec)(spec, 16, torch.bfloat16, torch.device("meta"))
    return sum(p.numel() for p in model.parameters()) * 2


def memory_figures(contexts: list[int]) -> dict:
    out: dict = {}
    for name, cfg in (("qwen3.5-9b", QWEN3_5_9B), ("qwen3-8b", QWEN3_8B)):
        spec = ModelSpec.from_dicts(cfg)
        lin = spec.linear_attention
        kv_layers = spec.num_layers - (lin.num_linear_layers if lin else 0)
        kv_per_token = 2 * kv_layers * spec.num_kv_heads * spec.head_dim * 2
        state = lin.state_bytes(2) if lin else 0
        weights = _weights_bytes(spec)
        left = CARD_BYTES * UTILIZATION - weights
        out[name] = {
            "weights_gib": weights / GIB,
            "kv_bytes_per_token": kv_per_token,
            "state_bytes_per_request": state,
            "per_request_mib": {n: (kv_per_token * n + state) / 2**20 for n in contexts},
            "concurrency_80gb": {n: int(left // (kv_per_token * n + state)) for n in contexts},
        }
    return out


def decode_throughput(new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
    from conveyor.testing.tiny_models import build_tiny_model

    path = build_tiny_model("/tmp/conveyor-bench-qwen3_5", "qwen3_5", num_layers=4)
    prompt = list(range(10, 42))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(str(path), dtype="float32", device="cpu", enable_prefix_caching=False))

    def run_engine(n: int) -> float:
        for i in range(n):
            engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, params)
        begin = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return n * new_tokens / (time.perf_counter() - begin)

    run_engine(1)  # warm-up
    ours_1, ours_8 = run_engine(1), run_engine(8)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # warm-up
        begin = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        hf_1 = new_tokens / (time.perf_counter() - begin)
    return {
        "new_tokens": new_tokens,
        "ours_tok_s_batch1": ours_1,
        "transformers_tok_s_batch1": hf_1,
        "ratio_batch1": ours_1 / hf_1,
        "ours_tok_s_batch8": ours_8,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    contexts = [1024, 4096, 32768]
    results = {"machine": machine_info(), "memory": memory_figures(contexts)}
    for name, fig in results["memory"].items():
        print(
            f"{name}: weights {fig['weights_gib']:.1f} GiB, KV {fig['kv_bytes_per_token'] / 1024:.0f} KiB/token, "
            f"state {fig['state_bytes_per_request'] / 2**20:.1f} MiB/request"
        )
        for n in contexts:
            print(
                f"  context {n}: {fig['per_request_mib'][n]:.0f} MiB/request, "
                f"{fig['concurrency_80gb'][n]} requests on 80 GB"
            )
    results["decode"] = decode_throughput(args.new_tokens)
    d = results["decode"]
    print(
        f"CPU decode (tiny Qwen3.5, fp32, {d['threads']} threads): ours {d['ours_tok_s_batch1']:.0f} tok/s vs "
        f"transformers {d['transformers_tok_s_batch1']:.0f} tok/s at batch 1 ({d['ratio_batch1']:.1f}x); "
        f"ours {d['ours_tok_s_batch8']:.0f} tok/s at batch 8"
    )
    write_results("hybrid.json", results)


if __name__ == "__main__":
    main()
