"""The layers the decoder families share: RMSNorm, rotary embedding, attention, the MLP and
the decoder layer, over a flat, unpadded batch of tokens, attention through an
``conveyor.engine.attention`` backend. ``conveyor.engine.models.llama``'s ``LlamaForCausalLM``
stacks them; the other families extend both.

Q/K/V and gate/up projections are fused into one matmul each at load time. RMSNorm (with the
residual add after attention fused into it) and SiLU-and-mul are the kernels' torch
references (``conveyor.kernels.reference``), which follow transformers' numerics, or on CUDA with the
triton attention backend the Triton kernels (``conveyor.kernels.fused_ops``): ``kernel_ops``.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.sharding import Shard, WeightSlot, head_shard, split
from conveyor.engine.models.kv_scale_fold import KVScaleFold
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.quantization.kept import linear_device
from conveyor.kernels import reference


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    # The kernels it runs: ``conveyor.kernels.reference``'s, or the Triton ones (``use_kernel_ops``).
    ops: ModuleType = reference

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: one pass with the Triton kernel."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def kernel_ops(device: torch.device, attention_backend: str) -> ModuleType:
    """The RMSNorm and SiLU-and-mul the layers run: the Triton kernels (``conveyor.kernels.fused_ops``)
    on CUDA with the triton attention backend (Triton is there and compiles), else the torch
    references, which follow transformers' numerics."""
    if device.type == "cuda" and attention_backend == "triton":
        from conveyor.kernels import fused_ops  # imports Triton: only where it is wanted

        return fused_ops
    return reference


def use_kernel_ops(model: nn.Module, ops: ModuleType) -> None:
    """Make ``model``'s norms and dense MLPs run ``ops`` (``kernel_ops``'s choice)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, MLP)):
            module.ops = ops
        elif callable(hook := getattr(module, "use_kernel_ops", None)):  # layers with kernels of their own
            hook(ops)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to ``max_len``, computed once in float32. With a partial
    rotary factor only the first ``rotary_dim`` dims of each head turn; the rest pass through."""

    cos: torch.Tensor  # buffers, [max_len, rotary_dim]
    sin: torch.Tensor

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inv_freq, scaling = spec.rope_inv_freq(max_len)
        self.rotary_dim = spec.rotary_dim
        self.partial = self.rotary_dim < spec.head_dim
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.partial:
            return _rotate_partial(q, cos, sin, self.rotary_dim), _rotate_partial(k, cos, sin, self.rotary_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    # The weights its forward only passes to ``F.linear``: a quantized checkpoint may keep them
    # quantized, multiplied through a kernel (``conveyor.engine.quantization.kept``).
    quantized_linears = ("qkv_weight", "o_weight")
    # This layer's attention window (``ModelSpec.layer_window``) and soft cap on the scores.
    sliding_window: int | None = None
    softcap: float | None = None

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # Under tensor parallelism, this rank's heads only (``conveyor.engine.distributed``).
        self.tp = parallel_state.current()
        self.heads = head_shard(spec.num_heads, spec.num_kv_heads, self.tp)
        self.num_heads, self.num_kv_heads, self.head_dim = self.heads.num_heads, self.heads.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_weight = _param(
            self.q_size + 2 * self.kv_size, spec.hidden_size, dtype=dtype, device=linear_device(device)
        )
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if spec.qkv_bias else None
        self.o_weight = _param(spec.hidden_size, self.q_size, dtype=dtype, device=linear_device(device))
        self.o_bias = _param(spec.hidden_size, dtype=dtype, device=device) if spec.o_bias else None
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        # The checkpoint's FP8 KV cache scales, where it has them and the cache is FP8
        # (``conveyor.engine.models.kv_scales``).
        self.kv_scales = KVScaleFold()

    def forward(self, x, positions, rope, backend: AttentionBackend, kv_cache):
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        q, k, v = self.kv_scales.fold_in(q, k, v)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], self.scale, sliding_window=self.sliding_window, softcap=self.softcap
        )
        out = self.kv_scales.fold_out(out)
        return self.tp.row_parallel_linear(out.reshape(-1, self.q_size), self.o_weight, self.o_bias)


class FeedForward(nn.Module):
    """A layer's feed-forward block, ``[tokens, hidden] -> [tokens, hidden]``: the dense
    ``MLP`` or a mixture of experts (``conveyor.engine.models.moe``)."""

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        """Its checkpoint tensor names under ``prefix`` -> (our tensor, row offset, rows[,
        the ``Shard`` of the checkpoint tensor this tensor-parallel rank takes])."""
        raise NotImplementedError


class MLP(FeedForward):
    # The weights its forward only passes to ``F.linear`` (``conveyor.engine.quantization.kept``).
    quantized_linears = ("gate_up_weight", "down_weight")
    # The kernels it runs: ``conveyor.kernels.reference``'s, or the Triton ones (``use_kernel_ops``).
    ops: ModuleType = reference

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        # Under tensor parallelism, this rank's slice of the intermediate dim.
        self.tp = parallel_state.current()
        self.inter_start, self.intermediate_size = split(intermediate_size or spec.intermediate_size, self.tp)
        inter = self.intermediate_size
        self.hidden_size = spec.hidden_size
        self.gate_up_weight = _param(2 * inter, spec.hidden_size, dtype=dtype, device=linear_device(device))
        self.gate_up_bias = _param(2 * inter, dtype=dtype, device=device) if spec.mlp_bias else None
        self.down_weight = _param(spec.hidden_size, inter, dtype=dtype, device=linear_device(device))
        self.down_bias = _param(spec.hidden_size, dtype=dtype, device=device) if spec.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        return self.tp.row_parallel_linear(self.ops.silu_and_mul(gate_up), self.down_weight, self.down_bias)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        """``gate_proj``/``up_proj``/``down_proj`` under ``prefix`` -> our fused tensors."""
        inter, start = self.intermediate_size, self.inter_start
        slots: dict[str, WeightSlot] = {}
        for name, weight, bias, off, rows, shard in (
            ("gate_proj", self.gate_up_weight, self.gate_up_bias, 0, inter, Shard.rows(start, inter)),
            ("up_proj", self.gate_up_weight, self.gate_up_bias, inter, inter, Shard.rows(start, inter)),
            ("down_proj", self.down_weight, self.down_bias, 0, self.hidden_size, Shard.cols(start, inter)),
        ):
            slots[f"{prefix}{name}.weight"] = (weight, off, rows, shard)
            if bias is not None:  # down_proj's bias is whole on every rank, added once after the sum
                slots[f"{prefix}{name}.bias"] = (bias, off, rows, shard) if shard.dim == 0 else (bias, off, rows)
        return slots


class DecoderLayer(nn.Module):
    """Attention then a feed-forward block: the dense ``MLP`` unless ``mlp`` gives another one
    (a mixture of experts), which maps ``[tokens, hidden]`` to the same shape and names its
    checkpoint tensors with ``weight_slots(prefix)``."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, mlp: FeedForward | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = Attention(spec, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp: FeedForward = mlp if mlp is not None else MLP(spec, dtype, device)

    def forward(self, x, positions, rope, backend, kv_cache):
        h = self.self_attn(self.input_layernorm(x), positions, rope, backend, kv_cache)
        h, x = self.post_attention_layernorm.add_and_norm(h, x)  # x + attention, and its norm
        return x + self.mlp(h)
