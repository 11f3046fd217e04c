"""What several commands' parsers share: the value checks of their flags, their help texts and
the options they have in common, defined once."""

from __future__ import annotations

import argparse

from conveyor.worker.entrypoints.cli.extra import missing_extra, worker_extra

with worker_extra():
    from conveyor.worker.batchio.records import InputFormat
    from conveyor.worker.store.models import JobStatus

# Choices a base install cannot list (its commands stop at the missing extra before using them).
FORMATS = [f.value for f in InputFormat] if missing_extra() is None else None
JOB_STATUSES = [s.value for s in JobStatus] if missing_extra() is None else None

FORMAT_HELP = "the input's format (default: from its first bytes, then its name)"
JOB_HELP = "the job id (batch_...), as submit printed it"
JSON_HELP = "print the job object as JSON (OpenAI's batch object)"
MODEL_HELP = "hub id (e.g. Qwen/Qwen3-0.6B), local checkpoint directory or s3://bucket/prefix/ (fetched once)"
INPUT_HELP = "input file: OpenAI Batch JSONL, plain JSONL with a prompt or messages, CSV or Parquet"


# ---- values ----------------------------------------------------------------------------


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def at_least_one(text: str) -> int:
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {value}")
    return value


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0 to 65535), got {value}")
    return value


# ---- options ---------------------------------------------------------------------------


def add_input_and_model(parser: argparse.ArgumentParser, model_help: str) -> None:
    """The input file and ``--model`` of a command that runs a job (``run``, ``submit``)."""
    parser.add_argument("input", help=INPUT_HELP)
    parser.add_argument("--model", required=True, help=model_help)


def add_shard_options(parser: argparse.ArgumentParser) -> None:
    """How a new job's input is read and cut into shards: ``--format``, ``--shard-size``, ``--shard-order``."""
    parser.add_argument("--format", choices=FORMATS, help=FORMAT_HELP)
    parser.add_argument("--shard-size", type=non_negative_int, help="requests per shard (default CONVEYOR_SHARD_SIZE)")
    parser.add_argument(
        "--shard-order",
        choices=("prefix", "input"),
        help="prefix: shards group lines sharing a prompt prefix; input: consecutive lines "
        "(default CONVEYOR_SHARD_ORDER)",
    )


def add_concurrency(parser: argparse.ArgumentParser, what: str) -> None:
    """``--concurrency``: ``what`` runs at once (``run``'s shards, ``worker``'s shard tasks)."""
    parser.add_argument(
        "--concurrency", type=non_negative_int, metavar="SHARDS",
        help=f"{what} at once, not requests: every request of a running shard goes to the engine, which runs "
        "up to its max_num_seqs together (default CONVEYOR_WORKER_CONCURRENCY, 4)",
    )  # fmt: skip


def add_job(parser: argparse.ArgumentParser) -> None:
    """The job a command acts on, by id."""
    parser.add_argument("job", help=JOB_HELP)


def add_json(parser: argparse.ArgumentParser, help: str = JSON_HELP) -> None:
    parser.add_argument("--json", action="store_true", help=help)
