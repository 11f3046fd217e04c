"""``python -m conveyor.engine``: run the engine over a prompt file and print outputs and throughput.

python -m conveyor.engine --example                       # a tiny local model, examples/prompts.txt
python -m conveyor.engine --model Qwen/Qwen3-0.6B --prompts my_prompts.txt --max-tokens 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from conveyor.engine import LLM, SamplingParams

EXAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts.txt"
EXAMPLE_MODEL = Path.home() / ".cache" / "conveyor" / "tiny-llama"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m conveyor.engine", description="Run prompts through the Conveyor engine."
    )
    ap.add_argument("--model", help="local checkpoint directory or hub id")
    ap.add_argument("--example", action="store_true", help="use (and build if needed) a tiny local random-weight model")
    ap.add_argument("--prompts", type=Path, help="a text file, one prompt per line (default: examples/prompts.txt)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode batches (GPU)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="split the model over this many processes")
    ap.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch's CPU threads, exactly (default: the CPUs this process may use, from its affinity and cgroup "
        "CPU quota, tuned down while a busy neighbour makes fewer threads faster)",
    )
    args = ap.parse_args(argv)

    model = args.model
    if model is None:
        if not args.example:
            ap.error("give --model or --example")
        if not (EXAMPLE_MODEL / "config.json").exists():
            from conveyor.testing.tiny_models import build_tiny_model

            print(f"building a tiny random-weight model in {EXAMPLE_MODEL} ...", file=sys.stderr)
            build_tiny_model(
                EXAMPLE_MODEL,
                "llama",
                hidden_size=128,
                num_layers=4,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=384,
            )
        model = str(EXAMPLE_MODEL)
    path = args.prompts or EXAMPLE_PROMPTS
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        ap.error(f"{path} has no prompts")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        llm = LLM(
            model,
            device=args.device,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
            cpu_threads=args.cpu_threads,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"engine: {llm.engine.cpu_budget.describe()}", file=sys.stderr)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs, strict=True):
        shown = out.text if out.error is None else f"<error: {out.error}>"
        print(f"--- {prompt!r}\n{shown!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    generated = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    print(
        f"\n{len(prompts)} prompts, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f}s: "
        f"{generated / elapsed:.1f} generated tok/s, {(prompt_tokens + generated) / elapsed:.1f} total tok/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
