"""``conveyor bench``: the engine measured on this machine with a synthetic batch workload, or
its cold start timed by phase."""

from __future__ import annotations

import argparse
from typing import Any

from conveyor.worker.entrypoints.cli.common import load_settings
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import print_json
from conveyor.worker.entrypoints.cli.options import MODEL_HELP

with worker_extra():
    from conveyor.worker.core.settings import Settings
    from conveyor.worker.store.model_cache import fetch_model, is_model_uri


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="measure the engine on this machine with a synthetic batch workload")
    bench.add_argument("--model", required=True, help=MODEL_HELP)
    bench.add_argument("--requests", type=int, default=256, help="requests, all submitted at once (default 256)")
    bench.add_argument("--prompt-tokens", default="64-512", help="N or LOW-HIGH (default 64-512)")
    bench.add_argument("--output-tokens", default="10-500", help="N or LOW-HIGH, EOS ignored (default 10-500)")
    bench.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix every prompt shares")
    bench.add_argument("--seed", type=int, default=0, help="random seed of the prompts and lengths (default 0)")
    bench.add_argument(
        "--cold-start", action="store_true", help="instead: time fresh processes building the engine, by phase "
        "(import, weights, kv_cache, cuda_graphs)",
    )  # fmt: skip
    bench.add_argument(
        "--repeat", type=int, default=3, help="with --cold-start: fresh processes, one after another (default 3)"
    )
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.set_defaults(fn=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from conveyor.testing.bench import TokenRange, format_result, run_bench  # the engine (see the package docstring)

    settings = load_settings()
    if is_model_uri(args.model):  # weights in an object store: the local copy (downloaded once)
        args.model = str(fetch_model(settings, args.model).path)
    if args.cold_start:
        return bench_cold_start(settings, args)
    result = run_bench(
        args.model,
        requests=args.requests,
        prompt_tokens=TokenRange.parse(args.prompt_tokens, "--prompt-tokens"),
        output_tokens=TokenRange.parse(args.output_tokens, "--output-tokens"),
        shared_prefix=args.shared_prefix,
        seed=args.seed,
        engine_args=settings.engine_args,
    )
    if args.json:
        print_json(result.as_dict())
    else:
        print(format_result(result))
    return 0


def bench_cold_start(settings: Settings, args: argparse.Namespace) -> int:
    from conveyor.testing.bench import format_cold_start, run_cold_start
    from conveyor.worker.execution.context import engine_config

    # The engine exactly as a worker builds it: its EngineConfig, CONVEYOR_ENGINE_ARGS applied.
    config = engine_config(settings, args.model).as_flat()
    model = config.pop("model")
    result = run_cold_start(model, engine_args=config, repeat=args.repeat)
    if args.json:
        print_json(result.as_dict())
    else:
        print(format_cold_start(result))
    return 0
