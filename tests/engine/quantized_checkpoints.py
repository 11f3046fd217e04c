"""Tiny quantized checkpoints written locally from a float one, each with a float twin holding
the exact weights the format stores (its dequantization, computed here from the integers
before they are packed, or by the compressed-tensors library), the oracle's checkpoint.

Each writer quantizes the decoder layers' linear weights (``*_proj.weight``) and keeps the
rest (embeddings, norms, the head) as they are, as llm-compressor, AutoAWQ and GPTQ do.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LINEAR = re.compile(r"model\.layers\.\d+\..*_proj\.weight$")
_FP8_MAX = 448.0
# AutoAWQ's order of eight output columns inside a word.
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

# A weight -> (its tensors in the format by suffix, the float weight they store).
Quantizer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_quantized(src: str | Path, dst: Path, quantization_config: dict, quantize: Quantizer) -> tuple[Path, Path]:
    """``dst/quantized`` and its float twin ``dst/reference``, from the checkpoint ``src``."""
    src = Path(src)
    quantized_dir, reference_dir = dst / "quantized", dst / "reference"
    for d in (quantized_dir, reference_dir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    quantized, reference = {}, {}
    for name, tensor in tensors.items():
        if _LINEAR.search(name):
            stem = name[: -len(".weight")]
            parts, dequantized = quantize(tensor.float())
            quantized.update({stem + suffix: part.contiguous() for suffix, part in parts.items()})
            reference[name] = dequantized.to(tensor.dtype)
        else:
            quantized[name] = reference[name] = tensor
    save_file(quantized, str(quantized_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(reference_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (quantized_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quantized_dir, reference_dir


# ---- FP8 (transformers' "fp8": per block or per tensor) ------------------------------
def fp8_block(block: tuple[int, int]) -> Quantizer:
    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows, cols = w.shape
        br, bc = block
        assert rows % br == 0 and cols % bc == 0, "the test's blocks tile the weight"
        blocks = w.reshape(rows // br, br, cols // bc, bc)
        scale = blocks.abs().amax(dim=(1, 3)) / _FP8_MAX
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        dequantized = (q.float() * scale[:, None, :, None]).reshape(rows, cols)
        return {".weight": q.reshape(rows, cols), ".weight_scale_inv": scale}, dequantized

    return quantize


def fp8_tensor(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().max() / _FP8_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    return {".weight": q, ".weight_scale": scale.reshape(())}, q.float() * scale


def with_input_scale(quantize: Quantizer) -> Quantizer:
    """A static per-tensor ``input_scale`` beside each weight, as calibration writes one: a
    different one a layer (q, k and v each their own), about the inputs' range here."""

    def with_scale(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        parts, dequantized = quantize(w)
        absmax = 2.0 + float(w.abs().sum()) % 2.0  # in [2, 4): a few inputs clip
        return {**parts, ".input_scale": torch.tensor([absmax / _FP8_MAX])}, dequantized

    return with_scale


# ---- int4 with groups along the inputs: the integers AWQ and GPTQ pack ----------------
def int4_groups(
    w: torch.Tensor, group_size: int, sym: bool, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, zeros, scales)``: unsigned 4-bit ``q`` [out, in], per group [out, groups]
    (GPTQ v1 stores zeros minus one, so its zeros start at ``min_zero=1``)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group_size, group_size)
    if sym:
        scales = g.abs().amax(-1) / 7.5
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scales = (hi - lo) / 15
        zeros = torch.round(-lo / scales).clamp(min_zero, 15).long()
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 15).long().reshape(rows, cols)
    return q, zeros, scales


def pack_words(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Along the last dim, ``32 // bits`` unsigned integers a word, the first in the lowest bits."""
    per_word = 32 // bits
    v = values.long().reshape(*values.shape[:-1], -1, per_word)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(per_word):
        words |= v[..., i] << (bits * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement into int32


def awq_gemm(group_size: int) -> Quantizer:
    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, zeros, scales = int4_groups(w, group_size, sym=False)
        qt, zt = q.t(), zeros.t()  # [in, out], [groups, out]
        order = torch.tensor([(c // 8) * 8 + AWQ_ORDER[c % 8] for c in range(qt.shape[1])])
        parts = {
            ".qweight": pack_words(qt[:, order]),
            ".qzeros": pack_words(zt[:, order]),
            ".scales": scales.t().contiguous(),
        }
        dequantized = (q - zeros.repeat_interleave(group_size, 1)) * scales.repeat_interleave(group_size, 1)
        return parts, dequantized

    return quantize


def gptq(group_size: int, sym: bool, desc_act: bool, seed: int = 0) -> Quantizer:
    """GPTQ v1: zeros stored minus one; with ``desc_act`` the inputs' groups follow a
    permutation (``g_idx``), as quantizing in activation order leaves them."""
    generator = torch.Generator().manual_seed(seed)

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        cols = w.shape[1]
        perm = torch.randperm(cols, generator=generator) if desc_act else torch.arange(cols)
        q_perm, zeros, scales = int4_groups(w[:, perm], group_size, sym, min_zero=1)
        q = torch.empty_like(q_perm)
        q[:, perm] = q_perm
        g_idx = torch.empty(cols, dtype=torch.int32)
        g_idx[perm] = (torch.arange(cols) // group_size).to(torch.int32)
        parts = {
            ".qweight": _pack_rows(q.t()),
            ".qzeros": pack_words(zeros.t() - 1),
            ".scales": scales.t().contiguous(),
            ".g_idx": g_idx,
        }
        g = g_idx.long()
        dequantized = (q - zeros[:, g]) * scales[:, g]
        return parts, dequantized

    return quantize


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Packed along the first dim: GPTQ's ``qweight`` [in / 8, out]."""
    return pack_words(values.t()).t()


# ---- compressed-tensors, written and decompressed by the library -------------------
def compressed_tensors(scheme_kwargs: dict, fmt: str) -> tuple[dict, Quantizer]:
    """The ``quantization_config`` and the quantizer of one compressed-tensors scheme."""
    from compressed_tensors.compressors import BaseCompressor  # type: ignore[import-untyped]
    from compressed_tensors.quantization import QuantizationScheme  # type: ignore[import-untyped]

    scheme = QuantizationScheme(targets=["Linear"], **scheme_kwargs)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    weights = scheme.weights

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        state = {"weight": w, **_ct_qparams(w, weights)}
        compressed = compressor.compress(state, scheme)
        dequantized = compressor.decompress(dict(compressed), scheme)["weight"]
        return {"." + k: v for k, v in compressed.items()}, dequantized.float()

    config = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {**scheme.model_dump(mode="json"), "format": fmt}},
    }
    return config, quantize


def _ct_qparams(w: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """Min-max scales (and zero points) as llm-compressor's observer computes them."""
    from compressed_tensors.quantization.utils import calculate_qparams  # type: ignore[import-untyped]

    rows, cols = w.shape
    if args.strategy == "group":
        g = w.reshape(rows, cols // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    params = {"weight_scale": scale.float()}
    if not args.symmetric:
        params["weight_zero_point"] = zero
    return params


def static_inputs(format_: tuple[dict, Quantizer]) -> tuple[dict, Quantizer]:
    """A format's config and quantizer, with a static ``input_scale`` beside each weight."""
    config, quantize = format_
    return config, with_input_scale(quantize)


# ---- W8A8: the oracle quantizes each quantized layer's input, with compressed-tensors' functions
def activation_args(quantization_config: dict):
    """compressed-tensors' ``QuantizationArgs`` of the inputs of a W8A8 checkpoint's layers, or
    ``None`` where its activations stay in full precision (the fp8 formats' by their
    documented meaning: static per tensor; dynamic by 1 x block groups or per tensor)."""
    from compressed_tensors.quantization import QuantizationArgs

    if quantization_config["quant_method"] == "compressed-tensors":
        groups = list(quantization_config["config_groups"].values())
        args = groups[0].get("input_activations")
        return QuantizationArgs(**args) if args else None
    if quantization_config["quant_method"] != "fp8":
        return None  # int4 weight-only
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    if quantization_config.get("activation_scheme") == "static":
        return QuantizationArgs(**fp8, strategy="tensor", dynamic=False)
    block = quantization_config.get("weight_block_size")
    if block:
        return QuantizationArgs(**fp8, strategy="group", group_size=block[1], dynamic=True)
    return QuantizationArgs(**fp8, strategy="tensor", dynamic=True)


def quantize_activations(model: torch.nn.Module, quantized_dir: Path) -> torch.nn.Module:
    """Hooks on transformers' ``model`` that fake-quantize the input of each linear layer
    whose weight the checkpoint ``quantized_dir`` quantizes, as the format says (its static
    ``input_scale``, or min-max scales over the input's tensor, tokens or groups: the
    observer's), through compressed-tensors' ``calculate_qparams`` and ``fake_quantize``."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # type: ignore[import-untyped]
    from compressed_tensors.quantization.utils import calculate_qparams

    config = json.loads((quantized_dir / "config.json").read_text())["quantization_config"]
    args = activation_args(config)
    if args is None:
        return model
    tensors = load_file(quantized_dir / "model.safetensors")

    def hook(module, inputs, input_scale=None):
        x = inputs[0]
        flat = x.reshape(-1, x.shape[-1])
        if input_scale is not None:
            scale, zero = input_scale.float(), torch.zeros_like(input_scale)
        else:
            if args.strategy == "token":
                lo, hi = flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True)
            elif args.strategy == "group":
                groups = flat.reshape(flat.shape[0], -1, args.group_size)
                lo, hi = groups.amin(-1), groups.amax(-1)
            else:
                lo, hi = flat.amin(), flat.amax()
            scale, zero = calculate_qparams(lo, hi, args)
        return (fake_quantize(flat, scale, zero, args).reshape(x.shape), *inputs[1:])

    hooked = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if not any(f"{name}.{suffix}" in tensors for suffix in ("weight_scale", "weight_scale_inv")):
            continue
        input_scale = tensors.get(f"{name}.input_scale")
        assert (input_scale is not None) == (not args.dynamic), name
        module.register_forward_pre_hook(lambda m, i, s=input_scale: hook(m, i, s))
        hooked += 1
    assert hooked, "no layer of the model is quantized"
    return model


def w8a8_oracle(hf_reference, quantized_dir: Path, oracle_dir: Path):
    """The ``hf_reference`` of ``oracle_dir``, its layers' inputs quantized as
    ``quantized_dir``'s format says (once: the reference is cached)."""
    hf = hf_reference(str(oracle_dir))
    if not getattr(hf.model, "_conveyor_w8a8", False):
        quantize_activations(hf.model, quantized_dir)
        hf.model._conveyor_w8a8 = True
    return hf


# ---- MXFP4 (gpt-oss as released) -------------------------------------------------------
# e2m1's magnitudes, by code (the sign is the code's fourth bit).
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# What the released gpt-oss config.json says beside transformers' fields (4.x spelling).
GPT_OSS_QUANTIZATION = {
    "modules_to_not_convert": [
        *("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
    ],
    "quant_method": "mxfp4",
}


def mxfp4_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight in transformers' ``[experts, in, out]`` as gpt-oss ships it:
    ``blocks`` uint8 ``[experts, out, in / 32, 16]`` (two e2m1 codes a byte, low nibble first)
    and ``scales`` uint8 ``[experts, out, in / 32]`` (the group's power of two, biased by 127),
    each group's largest magnitude at most 6 (e2m1's largest) times its scale."""
    rows = weight.float().transpose(-2, -1)
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2**-60))) - 2
    x = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (x.abs().unsqueeze(-1) - _E2M1).abs().argmin(-1) + 8 * (x < 0)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def write_released_gpt_oss(src: str | Path, dst: Path) -> Path:
    """The tiny gpt-oss checkpoint ``src`` in the released layout: the experts' ``gate_up_proj``
    and ``down_proj`` as ``*_blocks``/``*_scales`` (``mxfp4_pack``), everything else bfloat16,
    in two safetensors files with an index; config.json in the 4.x spelling the release uses
    (``rope_scaling``, ``rope_theta``, ``torch_dtype``, ``experts_per_token``) with its
    ``quantization_config``; and an ``original/`` folder of OpenAI's own format (other names),
    which a loader must not read."""
    src = Path(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = mxfp4_pack(tensor)
        else:
            out[name] = tensor.to(torch.bfloat16)
    names = sorted(out)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, part in halves.items():
        save_file({n: out[n] for n in part}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "original").mkdir()
    save_file({"block.0.attn.sinks": torch.zeros(2)}, str(dst / "original" / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config.pop("dtype", None)
    config.update(
        torch_dtype="bfloat16",
        experts_per_token=config["num_experts_per_tok"],
        initial_context_length=rope["original_max_position_embeddings"],
        quantization_config=GPT_OSS_QUANTIZATION,
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# Each format's ``quantization_config`` and quantizer, as a tiny checkpoint is written in it.
FORMATS: dict[str, Callable[[], tuple[dict, Quantizer]]] = {
    "fp8-block": lambda: (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [16, 32]},
        fp8_block((16, 32)),
    ),
    "fp8-tensor-static": lambda: (
        {"quant_method": "fp8", "activation_scheme": "static"},
        with_input_scale(fp8_tensor),
    ),
    "fp8-tensor-dynamic": lambda: ({"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_tensor),
    "awq": lambda: (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        awq_gemm(32),
    ),
    "gptq-sym": lambda: (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
        gptq(32, sym=True, desc_act=False),
    ),
    "gptq-asym-desc-act": lambda: (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
        gptq(32, sym=False, desc_act=True),
    ),
    "ct-w4a16": lambda: compressed_tensors(
        {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}},
        "pack-quantized",
    ),
    "ct-w4a16-asym": lambda: compressed_tensors(
        {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}},
        "pack-quantized",
    ),
    "ct-w8a8-fp8-channel": lambda: compressed_tensors(
        {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        },
        "float-quantized",
    ),
    "ct-w8a8-fp8-tensor-static": lambda: static_inputs(
        compressed_tensors(
            {
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
            },
            "float-quantized",
        )
    ),
    "ct-w8a16-fp8-channel": lambda: compressed_tensors(
        {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}},
        "float-quantized",
    ),
}
