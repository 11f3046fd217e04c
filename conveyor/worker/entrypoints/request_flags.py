"""The request options of ``conveyor run`` and ``conveyor submit``: chat, the system prompt and
the sampling defaults, as flags, turned into ``Client.submit``'s keywords.

Every sampling flag is a default under each line's own field (a line's ``temperature`` wins
over ``--temperature``); ``docs/user-guide/datasets.md`` lists the columns a dataset may carry.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from conveyor.worker.core.limits import DEFAULT_LIMITS

CHAT_HELP = (
    "render plain prompt rows (JSONL, CSV, Parquet) through the model's chat template as one user message "
    "(default: when the model's tokenizer has a chat template, as instruct models do; --no-chat sends the text "
    "as a raw completion prompt). messages rows always use the template; OpenAI Batch /v1/completions lines never"
)
SYSTEM_PROMPT_HELP = (
    "a system message put first in every chat request (messages rows, prompt rows rendered as chat, OpenAI Batch "
    "chat lines) that has none of its own; @FILE reads it from a file"
)
_SCHEMA_NAME = re.compile(r"[^A-Za-z0-9_-]+")


def _text_or_file(text: str) -> str:
    if not text.startswith("@"):
        return text
    path = Path(text[1:]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{str(path)!r} is not UTF-8 text") from None


def _number(kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _response_format(text: str) -> dict[str, Any]:
    if text in ("text", "json_object"):
        return {"type": text}
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected text, json_object or a JSON object such as OpenAI's response_format, got {text!r:.80}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r:.80}")
    return value


def _json_schema(text: str) -> dict[str, Any]:
    path = Path(text).expanduser()
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{str(path)!r} is not JSON: {exc}") from None
    name = _SCHEMA_NAME.sub("_", path.stem)[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """The chat and sampling flags, their defaults in their help."""
    group = parser.add_argument_group(
        "request options", "for every line of the input; a line's own field wins over a sampling flag"
    )
    group.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help=CHAT_HELP)
    group.add_argument("--system-prompt", type=_text_or_file, metavar="TEXT|@FILE", help=SYSTEM_PROMPT_HELP)
    group.add_argument(
        "--max-tokens", type=lambda t: _number(int, t), metavar="N",
        help=f"tokens generated per request at most (default {DEFAULT_LIMITS.default_max_tokens}, "
        "CONVEYOR_DEFAULT_MAX_TOKENS)",
    )  # fmt: skip
    group.add_argument(
        "--temperature", type=lambda t: _number(float, t), metavar="T",
        help="0 to 2; 0 is greedy (default 1.0)",
    )  # fmt: skip
    group.add_argument(
        "--top-p", type=lambda t: _number(float, t), metavar="P", help="nucleus sampling, above 0 to 1 (default 1.0)"
    )
    group.add_argument(
        "--seed", type=lambda t: _number(int, t), metavar="N",
        help="a seed for every request: the same input samples the same (default none: random)",
    )  # fmt: skip
    group.add_argument(
        "--stop", action="append", metavar="TEXT",
        help=f"stop at this text; repeatable, up to {DEFAULT_LIMITS.max_stop_sequences} (default none)",
    )  # fmt: skip
    group.add_argument("--n", type=lambda t: _number(int, t), metavar="N", help="completions per request (default 1)")
    formats = group.add_mutually_exclusive_group()
    formats.add_argument(
        "--response-format", type=_response_format, metavar="FORMAT",
        help="text, json_object, or OpenAI's response_format as JSON (default text)",
    )  # fmt: skip
    formats.add_argument(
        "--json-schema", type=_json_schema, metavar="FILE", dest="json_schema",
        help="answers follow this JSON Schema (a response_format of type json_schema, named after the file)",
    )  # fmt: skip


def request_options(args: argparse.Namespace) -> dict[str, Any]:
    """``Client.submit``'s request keywords from the parsed flags (None: not given)."""
    stop = args.stop
    return {
        "chat": args.chat,
        "system_prompt": args.system_prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": stop[0] if stop and len(stop) == 1 else stop,
        "n": args.n,
        "response_format": args.json_schema or args.response_format,
    }
