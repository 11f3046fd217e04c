"""Decode attention benchmark: our Triton paged attention vs PyTorch SDPA on dense KV.

Decode is memory-bandwidth bound, so the figure of merit is the achieved bandwidth
(bytes of K/V read / kernel time) as a fraction of the device's measured copy bandwidth.

    python -m benchmarks.bench_attention                       # batch 1/64/256 x context 512/2048
    python -m benchmarks.bench_attention --batches 1 8 --contexts 4096 --dtype float16

Shape defaults: Llama-3-8B-like (32 query heads, 8 KV heads, head_dim 128), bf16, block 16.
KV blocks are laid out in a random permutation (as a long-running paged cache would be).
Writes benchmarks/results/attention_<gpu>.json. Needs a CUDA GPU; elsewhere it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, copy_bandwidth_gbs, gpu_tag, graph_replay_ms, median_ms
from conveyor.kernels.interpreter import kernel_device
from conveyor.kernels.utils import cdiv

DEVICE = "cuda"


def _bench(fn) -> float:
    """Median milliseconds of ``fn``, each run from device memory (L2 flushed)."""
    return median_ms(fn, warmup=10, rep=50, flush_l2=True)


def _sdpa_fn(q, k_dense, v_dense, scale, group):
    """q [B, Hq, 1, D]; k/v_dense [B, Hkv, L, D]. GQA natively when torch supports it."""
    try:
        F.scaled_dot_product_attention(q[:1], k_dense[:1], v_dense[:1], scale=scale, enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k_dense, v_dense, scale=scale, enable_gqa=True), "sdpa(gqa)"
    except TypeError:  # torch < 2.5: expand the KV heads up front (outside the timing)
        k_rep = k_dense.repeat_interleave(group, dim=1)
        v_rep = v_dense.repeat_interleave(group, dim=1)
        return lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, scale=scale), "sdpa(expanded)"


def bench_decode(
    batch, ctx, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, copy_gbs, splits, device=DEVICE
):
    """One decode batch's attention: ours (automatic, unsplit and forced split counts) and SDPA
    on dense KV, timed. ``device``: ``cpu`` runs the kernels in the interpreter (dry runs)."""
    # Imported here: it imports Triton, which is optional (main() says so when there is no GPU).
    from conveyor.kernels.triton_ops import decode_num_kv_splits, paged_attention

    dev = torch.device(device)
    group = num_q_heads // num_kv_heads
    blocks_per_seq = cdiv(ctx, block_size)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn((num_blocks, block_size, num_kv_heads, head_dim), generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks - 1, device=dev, generator=gen) + 1
    block_tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn((batch, num_q_heads, head_dim), generator=gen, device=dev, dtype=dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = head_dim**-0.5
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * k_cache.element_size()

    auto_splits = decode_num_kv_splits(batch, num_q_heads, num_kv_heads, head_dim, dtype, ctx, dev)
    row = dict(batch=batch, context=ctx, kv_bytes=kv_bytes, auto_splits=auto_splits)

    def ours(ns):
        return lambda: paged_attention(
            q, k_cache, v_cache, block_tables, qsl, seq_lens, scale, 1, ctx, num_kv_splits=ns
        )

    variants = {"triton_auto": None, "triton_nosplit": 1}
    if splits:
        variants[f"triton_split{splits}"] = splits
    out_ours = ours(None)()
    for name, ns in variants.items():
        ms = _bench(ours(ns))
        row[name] = dict(ms=ms, gbs=kv_bytes / (ms * 1e-3) / 1e9)
        row[name]["frac_copy_bw"] = row[name]["gbs"] / copy_gbs
    # As the engine runs it, replayed from a CUDA graph: the kernels' own time, without the
    # Python launcher's overhead (which dominates small batches when launched one by one).
    graph_ms = graph_replay_ms(ours(None), flush_l2=True)
    if isinstance(graph_ms, float):
        row["triton_graph"] = dict(ms=graph_ms, gbs=kv_bytes / (graph_ms * 1e-3) / 1e9)
        row["triton_graph"]["frac_copy_bw"] = row["triton_graph"]["gbs"] / copy_gbs

    # SDPA on dense KV gathered from the same pages (gather not timed, then timed apart).
    def gather():
        k = k_cache[block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
        v = v_cache[block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2)
        return k.contiguous(), v.contiguous()

    k_dense, v_dense = gather()
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    sdpa, sdpa_kind = _sdpa_fn(q4, k_dense, v_dense, scale, group)
    ms = _bench(sdpa)
    row["sdpa"] = dict(kind=sdpa_kind, ms=ms, gbs=kv_bytes / (ms * 1e-3) / 1e9)
    row["sdpa"]["frac_copy_bw"] = row["sdpa"]["gbs"] / copy_gbs
    ms_g = _bench(lambda: sdpa_after_gather(gather, sdpa_kind, q4, scale, group))
    row["gather_plus_sdpa"] = dict(ms=ms_g)
    ref = sdpa().squeeze(2).float()
    row["max_abs_diff_vs_sdpa"] = (out_ours.float() - ref).abs().max().item()
    return row


def sdpa_after_gather(gather, kind, q4, scale, group):
    k, v = gather()
    if kind == "sdpa(gqa)":
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q4, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale=scale)


def machine_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(
        gpu=torch.cuda.get_device_name(0),
        sms=props.multi_processor_count,
        gpu_mem_gib=round(props.total_memory / 2**30, 1),
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        host=platform.node(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--num-q-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--splits", type=int, default=0, help="also time this forced split count")
    ap.add_argument("--out", default=None, help="JSON path (default results/attention_<gpu>.json)")
    args = ap.parse_args(argv)

    if kernel_device() != "cuda":
        print("bench_attention: needs a CUDA GPU (and TRITON_INTERPRET unset); skipping.")
        return 0

    dtype = getattr(torch, args.dtype)
    info = machine_info()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{info['gpu']} ({info['sms']} SMs), torch {info['torch']}, triton {info['triton']}")
    print(f"measured copy bandwidth: {copy_gbs:.0f} GB/s")
    shape = dict(
        num_q_heads=args.num_q_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=args.dtype,
    )
    print(f"decode, {shape}")
    rows = []
    hdr = (
        f"{'batch':>5} {'ctx':>5} {'splits':>6} | {'triton ms':>9} {'GB/s':>6} {'%copy':>6} | "
        f"{'nosplit ms':>10} {'%copy':>6} | {'sdpa ms':>8} {'GB/s':>6} {'%copy':>6} | "
        f"{'gather+sdpa ms':>14} | {'speedup':>7} {'maxdiff':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for ctx in args.contexts:
        for batch in args.batches:
            r = bench_decode(
                batch,
                ctx,
                dtype=dtype,
                copy_gbs=copy_gbs,
                splits=args.splits,
                num_q_heads=args.num_q_heads,
                num_kv_heads=args.num_kv_heads,
                head_dim=args.head_dim,
                block_size=args.block_size,
            )
            torch.cuda.empty_cache()  # the row's caches are gone: hand their memory back before the next
            rows.append(r)
            t, n, s = r["triton_auto"], r["triton_nosplit"], r["sdpa"]
            print(
                f"{batch:>5} {ctx:>5} {r['auto_splits']:>6} | {t['ms']:>9.4f} {t['gbs']:>6.0f} "
                f"{100 * t['frac_copy_bw']:>5.1f}% | {n['ms']:>10.4f} "
                f"{100 * n['frac_copy_bw']:>5.1f}% | {s['ms']:>8.4f} {s['gbs']:>6.0f} "
                f"{100 * s['frac_copy_bw']:>5.1f}% | {r['gather_plus_sdpa']['ms']:>14.4f} | "
                f"{s['ms'] / t['ms']:>6.2f}x {r['max_abs_diff_vs_sdpa']:>8.2e}"
            )

    out = Path(args.out) if args.out else RESULTS / f"attention_{gpu_tag()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            dict(benchmark="decode_attention", machine=info, copy_bandwidth_gbs=copy_gbs, shape=shape, rows=rows),
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
