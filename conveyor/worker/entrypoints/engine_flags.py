"""The engine flags of ``conveyor run`` and ``conveyor worker``: vLLM's names for
``EngineConfig``'s fields, defined once here (the parser and the docs' reference read this table).

A flag sets the same field as ``CONVEYOR_ENGINE_ARGS`` and wins over it. Values are parsed here
(numbers, choices) and checked by ``EngineConfig`` itself (``check_engine_flags``), so a bad one
is refused with the flag named before the model loads. Nothing here imports torch: the parser
is built for every command.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# ``conveyor.engine.config``'s choices, repeated (importing it imports torch); a test keeps them equal.
MODEL_IMPLS = ("auto", "native", "transformers")
DTYPES = ("auto", "bfloat16", "float", "float16", "float32", "half")
KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZATIONS = ("awq", "compressed-tensors", "fp8", "gguf", "gptq", "mxfp4")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


@dataclass(frozen=True)
class EngineFlag:
    """One flag: the ``EngineConfig`` field it sets and how its text is read."""

    field: str  # the flat field name, as in CONVEYOR_ENGINE_ARGS
    help: str
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    boolean: bool = False  # --flag / --no-flag
    vllm_note: str = ""  # where ours differs from vLLM's flag of the same name

    @property
    def option(self) -> str:
        return "--" + self.field.replace("_", "-")


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("dtype", "the weights' and activations' type (auto: float32 on CPU, else the checkpoint's half type)",
               choices=DTYPES),
    EngineFlag("max_model_len", "the longest sequence, prompt and output, in tokens (default: the model's limit)",
               _integer, metavar="TOKENS"),
    EngineFlag("gpu_memory_utilization", "on CUDA, the share of the GPU's memory the engine may fill: weights, "
               "activations and KV cache (default 0.9)", _number, metavar="FRACTION",
               vllm_note="the same share as vLLM's; on CPU the KV cache is sized from the weights instead "
               "(`kv_cache_memory_bytes` in CONVEYOR_ENGINE_ARGS sets it on any device)"),
    EngineFlag("tensor_parallel_size", "split the model over N GPUs, one process each (default 1)", _integer,
               metavar="N"),
    EngineFlag("max_num_seqs", "the most requests running at once (default 256)", _integer, metavar="N"),
    EngineFlag("enable_prefix_caching", "requests sharing a prompt prefix reuse its cached KV blocks (default on)",
               boolean=True),
    EngineFlag("kv_cache_dtype", "the KV cache's type: auto (the model's) or fp8 (e4m3, twice bf16's tokens)",
               choices=KV_CACHE_DTYPES),
    EngineFlag("quantization", "the quantization the checkpoint must carry (its config.json's quant_method, or "
               "gguf); a checkpoint quantized otherwise, or not at all, is refused", choices=QUANTIZATIONS,
               vllm_note="vLLM quantizes an unquantized checkpoint on load for some methods (fp8); Conveyor "
               "refuses it"),
    EngineFlag("model_impl", "whose forward pass runs the model: native (ours), transformers (its layers with our "
               "paged attention, for architectures we have no native code for) or auto (native when we have it)",
               choices=MODEL_IMPLS, vllm_note="vLLM's values are auto, vllm and transformers"),
    EngineFlag("speculative_config", "speculative decoding, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": "
               "4}' or '{\"method\": \"draft\", \"model\": \"DRAFT\", \"num_speculative_tokens\": 3}'", _json_object,
               metavar="JSON"),
)  # fmt: skip

GROUP_TITLE = "engine options"
GROUP_DESCRIPTION = (
    "EngineConfig's fields under vLLM's flag names; each wins over the same field in CONVEYOR_ENGINE_ARGS "
    "(the docs' EngineConfig reference lists them)"
)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(GROUP_TITLE, GROUP_DESCRIPTION)
    for flag in ENGINE_FLAGS:
        if flag.boolean:
            group.add_argument(flag.option, dest=flag.field, action=argparse.BooleanOptionalAction, help=flag.help)
        elif flag.parse is not None:
            group.add_argument(flag.option, dest=flag.field, type=flag.parse, metavar=flag.metavar, help=flag.help)
        else:
            group.add_argument(flag.option, dest=flag.field, choices=flag.choices, help=flag.help)


def given_engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields the command line set, by field name."""
    return {f.field: value for f in ENGINE_FLAGS if (value := getattr(args, f.field, None)) is not None}


def check_engine_flags(given: Mapping[str, Any]) -> None:
    """Each flag's value through ``EngineConfig``'s own checks, alone; ``ValueError`` naming
    the flag. (Checks across fields run when the worker builds its config.)"""
    from conveyor.engine.config import EngineConfig  # torch: only the commands that run the engine get here

    by_field = {f.field: f for f in ENGINE_FLAGS}
    for field, value in given.items():
        try:
            EngineConfig("-", device="cpu", **{field: value})  # (on CPU: the GPU count is checked later)
        except (TypeError, ValueError) as exc:
            shown = json.dumps(value) if isinstance(value, dict) else str(value)
            raise ValueError(f"{by_field[field].option} {shown}: {exc}") from None
