"""``kv_cache_dtype="fp8"``: K/V stored as e4m3 (scale 1), read back by the torch attention
backend and by the triton one (its kernels in the interpreter here); the memory budget
counts one byte an element. Teacher-forced against transformers: each generated token's
logprob under ours and under transformers' float32 forward over the same tokens, where
transformers' attention gets its keys and values rounded through e4m3 (an attention
function registered with its ``AttentionInterface``), agrees within ``FP8_LOGPROB_BOUND``;
the same engine with the model's dtype agrees with plain transformers to float32 rounding.

A checkpoint's own scales (compressed-tensors' ``kv_cache_scheme`` with ``self_attn.k_scale``/
``v_scale``, per tensor or per KV head, set here from transformers' K/V maxima) are checked the
same way against transformers rounding ``x / scale`` through e4m3 and back times ``scale``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.parallel_state import ParallelState
from conveyor.engine.models.kv_scales import CheckpointKVScales
from conveyor.engine.models.layers import Attention
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.quantization import scheme_from_config
from tests.engine.reference import oracle_model

PROMPTS = ["The chef will bring", "Seven guests wait at the table and the waiter pours cold water", "Tea"]
# The largest difference of a token's logprob from transformers' with e4m3-rounded K/V.
FP8_LOGPROB_BOUND = 1e-2


# layer -> (K scales, V scales), [1] or [num_kv_heads]
KVScales = dict[int, tuple[torch.Tensor, torch.Tensor]]


def _fp8_kv_attention(scales: KVScales | None):
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.reshape(1, -1, 1, 1)  # over [batch, kv_heads, tokens, head_dim]
        return (x / s).to(torch.float8_e4m3fn).to(x.dtype) * s

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = scales[module.layer_idx] if scales else (torch.ones(1), torch.ones(1))
        return eager_attention_forward(module, query, rounded(key, k_scale), rounded(value, v_scale), *args, **kwargs)

    return attention


def _logprob_errors(
    llm: LLM, path: str, fp8_reference: bool = False, max_tokens: int = 24, scales: KVScales | None = None
) -> list[float]:
    if fp8_reference:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        # Eager attention's additive mask too (a new name would get SDPA's boolean one).
        AttentionInterface.register("conveyor_fp8_kv_eager", _fp8_kv_attention(scales))
        AttentionMaskInterface.register("conveyor_fp8_kv_eager", eager_mask)
        hf = oracle_model(path)
        hf.set_attn_implementation("conveyor_fp8_kv_eager")
    else:
        hf = oracle_model(path)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1))
    errors = []
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logprobs = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.logprobs is not None
        for i, (token, ours) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            theirs = float(logprobs[len(out.prompt_token_ids) + i - 1, token])
            errors.append(abs(ours[token] - theirs))
    return errors


def test_fp8_kv_cache_logprobs_stay_within_the_bound(tiny_models, make_llm):
    path = tiny_models("qwen3")
    # Small blocks and budget: decodes read the cache, prompts are chunked and preempted.
    kwargs = {"block_size": 4, "max_num_batched_tokens": 8}
    exact = _logprob_errors(make_llm(path, **kwargs), path)
    fp8_llm = make_llm(path, kv_cache_dtype="fp8", **kwargs)
    fp8 = _logprob_errors(fp8_llm, path, fp8_reference=True)
    against_exact = _logprob_errors(fp8_llm, path)
    print(
        f"logprob error: model dtype {max(exact):.1e}; fp8 KV {max(fp8):.1e} vs e4m3-rounded "
        f"transformers, {max(against_exact):.2f} vs plain transformers"
    )
    assert max(exact) < 1e-3
    assert max(fp8) < FP8_LOGPROB_BOUND
    assert max(against_exact) > 10 * FP8_LOGPROB_BOUND  # the FP8 cache is really what is read


def test_the_budget_counts_one_byte_per_element(tiny_models, make_llm):
    path = tiny_models("llama")
    budget = 1 << 20
    auto = make_llm(path, kv_cache_memory_bytes=budget)
    fp8 = make_llm(path, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.runner.num_blocks == 4 * auto.engine.runner.num_blocks  # float32: 4 bytes -> 1


def test_the_triton_backend_reads_the_fp8_cache_within_the_bound(tiny_models, make_llm):
    path = tiny_models("qwen3")
    llm = make_llm(path, kv_cache_dtype="fp8", attention_backend="triton", block_size=4, max_num_batched_tokens=8)
    fp8 = _logprob_errors(llm, path, fp8_reference=True, max_tokens=12)
    print(f"logprob error: fp8 KV through the triton kernels {max(fp8):.1e} vs e4m3-rounded transformers")
    assert max(fp8) < FP8_LOGPROB_BOUND


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("unused", kv_cache_dtype="int8")


# ---- the checkpoint's scales --------------------------------------------------------


def _kv_maxima(path: str) -> KVScales:
    """Each layer's largest |K| and |V| per KV head over the prompts, from transformers."""
    from transformers import AttentionInterface
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    maxima: KVScales = {}

    def recording(module, query, key, value, *args, **kwargs):
        seen = [x.abs().amax(dim=(0, 2, 3)) for x in (key, value)]  # [kv_heads]
        old = maxima.get(module.layer_idx)
        maxima[module.layer_idx] = (
            (seen[0], seen[1]) if old is None else (old[0].maximum(seen[0]), old[1].maximum(seen[1]))
        )
        return eager_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("conveyor_kv_maxima", recording)
    hf = oracle_model(path)
    hf.set_attn_implementation("conveyor_kv_maxima")
    with torch.no_grad():
        for prompt in PROMPTS:
            hf(torch.tensor([hf_tokens(path, prompt)]))
    return maxima


def hf_tokens(path: str, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def write_kv_scaled(src: str, dst: Path, scales: KVScales, strategy: str, tensors: dict | None = None) -> str:
    """``src`` with llm-compressor's FP8 KV cache config and ``scales`` as its
    ``self_attn.k_scale``/``v_scale`` tensors (``tensors``: instead of those)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    if tensors is None and strategy == "kv_scale":  # an older FP8 checkpoint's one scalar for K and V
        tensors = {f"model.layers.{layer}.self_attn.kv_scale": k.reshape(()) for layer, (k, _) in scales.items()}
    elif tensors is None:
        tensors = {}
        for layer, (k, v) in scales.items():
            for name, scale in (("k_scale", k), ("v_scale", v)):
                shaped = scale.reshape(-1, 1, 1) if strategy == "attn_head" else scale.reshape(1)
                tensors[f"model.layers.{layer}.self_attn.{name}"] = shaped.contiguous()
    save_file({**weights, **tensors}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if strategy == "kv_scale":
        return str(dst)  # its scale tensors without a quantization_config
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {},
        "kv_cache_scheme": {**KV_CACHE_SCHEME, "strategy": strategy},
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)


@pytest.fixture(scope="module")
def kv_maxima(tiny_models):
    return _kv_maxima(tiny_models("qwen3"))


def _scales(maxima: KVScales, strategy: str) -> KVScales:
    """max|x| / 448: e4m3's whole range used, where a scale of 1 leaves most values subnormal."""
    if strategy == "kv_scale":
        both = {layer: torch.maximum(k.max(), v.max()).reshape(1) / 448 for layer, (k, v) in maxima.items()}
        return {layer: (scale, scale) for layer, scale in both.items()}
    if strategy == "tensor":
        return {layer: (k.max().reshape(1) / 448, v.max().reshape(1) / 448) for layer, (k, v) in maxima.items()}
    return {layer: (k / 448, v / 448) for layer, (k, v) in maxima.items()}


@pytest.mark.parametrize(
    "strategy, backend", [("tensor", "torch"), ("attn_head", "torch"), ("attn_head", "triton"), ("kv_scale", "torch")]
)
def test_the_checkpoints_kv_scales_are_applied_within_the_bound(
    tiny_models, make_llm, kv_maxima, tmp_path, strategy, backend
):
    path = tiny_models("qwen3")
    scales = _scales(kv_maxima, strategy)
    scaled = write_kv_scaled(path, tmp_path / "scaled", scales, strategy)
    kwargs = {"block_size": 4, "max_num_batched_tokens": 8, "attention_backend": backend}
    max_tokens = 4 if backend == "triton" else 24  # the interpreter is slow; the fold is the same
    ours = _logprob_errors(
        make_llm(scaled, kv_cache_dtype="fp8", **kwargs), path, fp8_reference=True, max_tokens=max_tokens, scales=scales
    )
    print(f"logprob error: fp8 KV at the checkpoint's {strategy} scales ({backend}) {max(ours):.1e}")
    assert max(ours) < FP8_LOGPROB_BOUND


def test_without_the_scales_the_fp8_cache_is_measurably_worse(tiny_models, make_llm, kv_maxima, tmp_path):
    path = tiny_models("qwen3")
    scales = _scales(kv_maxima, "attn_head")
    scaled = write_kv_scaled(path, tmp_path / "scaled", scales, "attn_head")
    kwargs = {"block_size": 4, "max_num_batched_tokens": 8}
    unscaled = _logprob_errors(make_llm(path, kv_cache_dtype="fp8", **kwargs), path, fp8_reference=True, scales=scales)
    # kv_cache_dtype "auto": the scales are ignored, the model's own dtype is cached.
    auto = _logprob_errors(make_llm(scaled, **kwargs), path)
    print(f"logprob error: fp8 KV at scale 1 {max(unscaled):.1e} vs transformers at the checkpoint's scales")
    assert max(unscaled) > 10 * FP8_LOGPROB_BOUND
    assert max(auto) < 1e-3


@pytest.mark.parametrize(
    "kv_cache_scheme, named",
    [
        ({**KV_CACHE_SCHEME, "dynamic": True}, "kv_cache_scheme.dynamic"),
        ({**KV_CACHE_SCHEME, "type": "int"}, "kv_cache_scheme.type"),
        ({**KV_CACHE_SCHEME, "symmetric": False}, "kv_cache_scheme.symmetric"),
        ({**KV_CACHE_SCHEME, "strategy": "channel"}, "kv_cache_scheme.strategy"),
        ({**KV_CACHE_SCHEME, "num_bits": 4}, "kv_cache_scheme.num_bits"),
    ],
)
def test_an_unsupported_kv_cache_scheme_is_refused_by_name(kv_cache_scheme, named):
    config = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": kv_cache_scheme}
    with pytest.raises(ValueError, match="compressed-tensors") as info:
        scheme_from_config({"quantization_config": config})
    assert named in str(info.value)


def _one(value: float) -> torch.Tensor:
    return torch.tensor([value])


@pytest.mark.parametrize(
    "family, tensors, message",
    [
        ("qwen3", {"model.layers.0.self_attn.k_scale": _one(0.01)}, "k_scale and v_scale go together"),
        ("qwen3", {"model.layers.0.self_attn.kv_scale": torch.ones(3)}, "one per KV head"),
        ("qwen3", {"model.layers.0.self_attn.kv_scale": _one(0.0)}, "finite and positive"),
        ("gpt_oss", {"model.layers.0.self_attn.kv_scale": _one(0.01)}, "GptOssAttention.*does not apply"),
    ],
)
def test_kv_scales_that_cannot_be_applied_are_refused_at_load(tiny_models, tmp_path, family, tensors, message):
    checkpoint = write_kv_scaled(tiny_models(family), tmp_path / "scaled", {}, "tensor", tensors=tensors)
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint, kv_cache_dtype="fp8", device="cpu", dtype="float32")


def test_each_tensor_parallel_rank_folds_its_kv_heads_scales(tiny_models):
    # 8 query heads in 2 groups of 4 (KV heads 0 and 1) over 4 ranks of 2 query heads each.
    spec = dataclasses.replace(ModelSpec.from_pretrained(tiny_models("qwen3")), num_heads=8, num_kv_heads=2)
    k_scale, v_scale = torch.tensor([0.5, 0.25]), torch.tensor([2.0, 4.0])
    for rank in range(4):
        parallel_state.set_state(ParallelState(rank, 4))
        try:
            attn = Attention(spec, torch.float32, torch.device("cpu"))
        finally:
            parallel_state.reset()
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Module()])
        model.layers[0].self_attn = attn
        scales = CheckpointKVScales(spec.num_kv_heads)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            assert scales.take(f"model.layers.0.self_attn.{name}", _reader(scale))
        scales.install(model, "fp8")
        kv_head = rank // 2  # transformers' grouping: query head h attends with KV head h // 4
        assert attn.kv_scales.k_scale.flatten().tolist() == [k_scale[kv_head]]
        assert attn.kv_scales.q_factor.flatten().tolist() == [k_scale[kv_head]] * 2
        assert attn.kv_scales.out_factor.flatten().tolist() == [v_scale[kv_head]] * 2


def _reader(tensor: torch.Tensor) -> Callable[[None], torch.Tensor]:
    return lambda _: tensor
