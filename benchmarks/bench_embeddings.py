"""Embeddings: Conveyor's engine (``LLM.embed``) against sentence-transformers' ``encode``.

The same random-weight embedder, a Qwen3 decoder (last-token pooling, normalised, as
Qwen3-Embedding) or with ``--family bert`` a BERT encoder (CLS pooling, normalised, as
bge-small), embeds the same inputs of mixed length (16 to 512 tokens, uniform) with both, one after the
other in one process on the same threads: sentence-transformers with its default batching
(batches of 32 after sorting by length), the engine with its defaults (continuous batching,
``max_num_batched_tokens`` tokens a step, no padding). Reports inputs/s and tokens/s of each,
the ratio, and the worst cosine between the two sets of vectors. Writes
benchmarks/results/embeddings.json and embeddings.png (``embeddings-bert.*`` for the encoder).

    python -m benchmarks.bench_embeddings [--inputs 512] [--hidden 256] [--layers 4] [--family bert]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, write_results
from conveyor.engine import LLM
from conveyor.testing.tiny_models import _WORDS, add_sentence_transformers_files, build_tiny_encoder, build_tiny_model

# Each family's pooling, as its released embedders have it.
POOLING = {"qwen3": "last", "bert": "cls"}


def model_dir(hidden: int, layers: int, family: str = "qwen3") -> Path:
    suffix = "" if family == "qwen3" else f"-{family}"
    path = Path(tempfile.gettempdir()) / f"conveyor-bench-embed-{hidden}x{layers}{suffix}"
    if not (path / "modules.json").exists():
        if family == "bert":
            build_tiny_encoder(
                path, "bert", hidden_size=hidden, num_layers=layers, num_heads=8, intermediate_size=4 * hidden
            )
        else:
            build_tiny_model(
                path, "qwen3", hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4,
                intermediate_size=3 * hidden, max_position_embeddings=2048,
            )  # fmt: skip
        add_sentence_transformers_files(path, POOLING[family], True)
    return path


def make_inputs(tokenizer, n: int, seed: int) -> list[str]:
    """Texts of 16 to 512 tokens (uniform), cut to their length with the model's tokenizer."""
    rng = random.Random(seed)
    specials = len(tokenizer.encode(""))  # what the tokenizer adds around a text (an encoder's CLS, SEP)
    texts = []
    for _ in range(n):
        want = rng.randint(16, 512)
        words = " ".join(rng.choice(_WORDS) for _ in range(want * 2))
        ids = tokenizer.encode(words, add_special_tokens=False)[: want - specials]
        texts.append(tokenizer.decode(ids))
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=sorted(POOLING), default="qwen3")
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    path = model_dir(args.hidden, args.layers, args.family)
    name = "embeddings" if args.family == "qwen3" else f"embeddings-{args.family}"
    llm = LLM(str(path), dtype="float32", device="cpu")
    texts = make_inputs(llm.get_tokenizer(), args.inputs, args.seed)
    tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    llm.embed(texts[:8])  # warm up both
    st = SentenceTransformer(str(path), device="cpu")
    st.encode(texts[:8])

    t0 = time.perf_counter()
    ref = st.encode(texts, convert_to_tensor=True)
    st_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.embed(texts)
    ours_s = time.perf_counter() - t0
    got = torch.tensor([o.embedding for o in outs])
    worst_cos = torch.nn.functional.cosine_similarity(got, ref.float(), dim=1).min().item()
    results = {
        "model": {
            "family": args.family,
            "hidden_size": args.hidden,
            "layers": args.layers,
            "pooling": POOLING[args.family],
        },
        "inputs": args.inputs,
        "tokens": tokens,
        "input_lengths": "16-512 tokens, uniform",
        "sentence_transformers": {"seconds": st_s, "inputs_per_s": args.inputs / st_s, "tokens_per_s": tokens / st_s},
        "conveyor": {"seconds": ours_s, "inputs_per_s": args.inputs / ours_s, "tokens_per_s": tokens / ours_s},
        "speedup": st_s / ours_s,
        "worst_cosine": worst_cos,
        "threads": torch.get_num_threads(),
    }
    print(
        f"{args.inputs} inputs, {tokens} tokens: sentence-transformers {args.inputs / st_s:.1f} inputs/s, "
        f"conveyor {args.inputs / ours_s:.1f} inputs/s ({st_s / ours_s:.2f}x); worst cosine {worst_cos:.6f}"
    )
    write_results(f"{name}.json", results)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = ["sentence-transformers\nencode", "conveyor\nLLM.embed"]
    rates = [args.inputs / st_s, args.inputs / ours_s]
    ax.bar(names, rates, color=["#999999", "#1f77b4"])
    ax.set_ylabel("inputs/s")
    ax.set_title(f"{args.family}: {args.inputs} inputs of 16-512 tokens, CPU ({torch.get_num_threads()} threads)")
    for i, r in enumerate(rates):
        ax.text(i, r, f"{r:.1f}", ha="center", va="bottom")
    fig.tight_layout()
    out = RESULTS / f"{name}.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
