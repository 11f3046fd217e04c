"""vLLM's engine flags on ``conveyor run`` and ``conveyor worker``: each reaches its
``EngineConfig`` field over ``CONVEYOR_ENGINE_ARGS``, and a bad value is refused by its flag
before any model loads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.engine.config import DTYPES, KV_CACHE_DTYPES, MODEL_IMPLS, QUANTIZATIONS, EngineConfig
from conveyor.engine.quantization.registry import SCHEMES
from conveyor.worker.entrypoints import engine_flags
from conveyor.worker.entrypoints.cli import build_parser, main
from conveyor.worker.execution.context import WorkerContext, engine_config
from tests.worker.helpers import jsonl, openai_lines, record_engine_builds


def test_run_builds_its_engine_with_the_flags_over_the_environment(embedded_stack, env, tmp_path, monkeypatch):
    stack = env(embedded_stack)
    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", json.dumps({"max_num_seqs": 64, "block_size": 8}))
    seen = record_engine_builds(monkeypatch)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(jsonl(openai_lines(3)))
    argv = ["run", str(src), "--model", stack.model, "-o", str(out), "-q", "--max-num-seqs", "3",
            "--dtype", "float32", "--no-enable-prefix-caching", "--max-model-len", "200"]  # fmt: skip
    assert main(argv) == 0
    [config] = seen
    assert (config.max_num_seqs, config.dtype, config.enable_prefix_caching) == (3, "float32", False)
    assert config.max_model_len == 200 and config.block_size == 8  # the environment's other fields kept
    assert len(out.read_text().splitlines()) == 3


def _worker_config(monkeypatch, *argv: str) -> EngineConfig:
    class Stop(Exception):
        pass

    seen: dict[str, Any] = {}

    def create(settings, *args: Any, **kwargs: Any):
        seen["config"] = engine_config(settings, "m")
        raise Stop

    monkeypatch.setattr(WorkerContext, "create", create)
    args = build_parser().parse_args(["worker", "--model", "m", *argv])
    with pytest.raises(Stop):
        args.fn(args)
    return seen["config"]


def test_every_worker_flag_reaches_its_field(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", json.dumps({"dtype": "bfloat16", "device": "cpu"}))
    config = _worker_config(
        monkeypatch, "--dtype", "float16", "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
        "--tensor-parallel-size", "2", "--max-num-seqs", "7", "--no-enable-prefix-caching",
        "--kv-cache-dtype", "fp8", "--quantization", "awq", "--model-impl", "native",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
    )  # fmt: skip
    flat = config.as_flat()
    assert {f.field: flat[f.field] for f in engine_flags.ENGINE_FLAGS} == {
        "dtype": "float16", "max_model_len": 512, "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2,
        "max_num_seqs": 7, "enable_prefix_caching": False, "kv_cache_dtype": "fp8", "quantization": "awq",
        "model_impl": "native",
        "speculative_config": {**flat["speculative_config"], "method": "ngram", "num_speculative_tokens": 2},
    }  # fmt: skip
    assert config.device == "cpu"
    # Without flags the environment decides.
    assert _worker_config(monkeypatch).dtype == "bfloat16"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs 0: max_num_seqs must be a positive integer, got 0"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: gpu_memory_utilization must be in (0, 1]"),
        (["--max-model-len", "-4"], "--max-model-len -4: max_model_len must be positive, got -4"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0: tensor_parallel_size must be a positive integer"),
    ],
)
def test_a_bad_value_is_refused_by_its_flag_before_the_model_loads(
    argv, message, embedded_stack, env, tmp_path, monkeypatch, capsys
):
    stack = env(embedded_stack)
    seen = record_engine_builds(monkeypatch)
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(openai_lines(1)))
    assert main(["run", str(src), "--model", stack.model, "-q", *argv]) == 1
    assert f"conveyor: error: {message}" in capsys.readouterr().err
    assert seen == []  # no engine was built


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: expected an integer, got 'many'"),
        (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
        (["--quantization", "bnb"], "argument --quantization: invalid choice: 'bnb'"),
    ],
)
def test_a_value_of_the_wrong_kind_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["run", "in.jsonl", "--model", "m", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_choices_are_the_engines():
    assert sorted(engine_flags.DTYPES) == sorted(["auto", *DTYPES])
    assert engine_flags.KV_CACHE_DTYPES == KV_CACHE_DTYPES
    assert engine_flags.MODEL_IMPLS == MODEL_IMPLS
    assert engine_flags.QUANTIZATIONS == QUANTIZATIONS == tuple(sorted([*SCHEMES, "gguf"]))
    assert {f.field for f in engine_flags.ENGINE_FLAGS} <= EngineConfig.flat_field_names()


def test_a_checkpoint_quantized_otherwise_is_refused_before_its_weights_load(tiny_models):
    from conveyor.engine import LLM

    with pytest.raises(ValueError, match=r"quantization='awq', but .* is not quantized; Conveyor loads a checkpoint"):
        LLM(tiny_models("llama"), device="cpu", quantization="awq")
