"""gpt-oss (``GptOssForCausalLM``): the Llama layers with gpt-oss's differences, each following
transformers' ``modeling_gpt_oss``:

- attention with biases on q/k/v/o and a learned sink per query head: one more logit in each
  head's softmax, with no value (``sinks`` in the attention backends and the kernel);
- sliding-window and full layers alternating (``layer_types``), YaRN RoPE (``ModelSpec``);
- RMSNorm computed in float32 and multiplied by the weight before rounding (transformers keeps
  the norms in float32);
- every layer a mixture of experts: the router (with a bias) picks the top-k logits and
  softmaxes those k only; each expert is a SwiGLU with biases whose gate and up columns are
  interleaved, the gate clamped above at ``swiglu_limit``, up clamped to ``±swiglu_limit``,
  ``(up + 1) * gate * sigmoid(alpha * gate)``.

The checkpoint is the unquantized one transformers' ``save_pretrained`` writes: experts stacked
as ``gate_up_proj [experts, hidden, 2 * inter]`` and ``down_proj [experts, inter, hidden]``,
kept in that layout here so the loader copies them as they are. On CUDA the experts run on the
fused Triton MoE kernel (``conveyor.kernels.fused_moe``, its clamped-SwiGLU activation with biases,
reading the weights through transposed views), so the decode is captured in CUDA graphs; a
released checkpoint's MXFP4 experts stay 4-bit there (``conveyor.engine.quantization.kept``), decoded
inside the kernel's K loop. Elsewhere they run on the token-sorted torch path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.sharding import Shard, WeightSlot, split
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.layers import Attention, DecoderLayer, FeedForward, RMSNorm, _param
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, decoder_spec, sliding_per_layer
from conveyor.engine.models.moe import SparseMoE, every_layer_sparse, fused_moe_kernel
from conveyor.engine.quantization.kept import linear_device
from conveyor.kernels.reference import ClampedSwiGLU, Mxfp4Weight


class GptOssRMSNorm(RMSNorm):
    """RMSNorm as transformers' gpt-oss and OLMo 3 compute it: float32 throughout, multiplied
    by the weight before the one rounding to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class GptOssAttention(Attention):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        self.sinks = _param(self.num_heads, dtype=dtype, device=device)  # this rank's heads'

    def forward(self, x, positions, rope, backend, kv_cache):
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], self.scale, sliding_window=self.sliding_window, sinks=self.sinks
        )
        return self.tp.row_parallel_linear(out.reshape(-1, self.q_size), self.o_weight, self.o_bias)


def _kernel_weight(weight: torch.Tensor) -> torch.Tensor | Mxfp4Weight:
    """Stacked experts' weight ``[experts, in, out]`` as the fused kernel reads it: kept MXFP4,
    or a transposed view (``[experts, out, in]``, no copy)."""
    kept = getattr(weight, "kernel", None)
    return kept if isinstance(kept, Mxfp4Weight) else weight.transpose(1, 2)


class GptOssExperts(FeedForward):
    """The router and the experts of one layer (transformers' ``GptOssMLP``)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None and spec.swiglu_limit is not None  # (set for every gpt-oss config)
        self.num_experts, self.top_k, self.hidden_size = moe.num_experts, moe.top_k, spec.hidden_size
        self.alpha, self.limit = spec.swiglu_alpha, spec.swiglu_limit
        # Under tensor parallelism, this rank's slice of every expert's intermediate dim.
        self.tp = parallel_state.current()
        self.inter_start, self.intermediate_size = split(moe.intermediate_size, self.tp)
        e, inter, hidden = moe.num_experts, self.intermediate_size, spec.hidden_size
        self.router_weight = _param(e, hidden, dtype=dtype, device=device)
        self.router_bias = _param(e, dtype=dtype, device=device)
        # The experts' path, as ``SparseMoE`` picks it (the tests force it with that class's switch).
        use_fused = SparseMoE.use_fused_kernel
        if use_fused is None:
            use_fused = torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None
        # Loading a quantized checkpoint, the fused kernel's experts start on the meta device: kept
        # in MXFP4 they never exist as floats (gpt-oss-120b's are 4x larger so), and given
        # memory only should they stay dequantized (``conveyor.engine.quantization.kept``).
        experts_at = linear_device(torch.device(device)) if use_fused else device
        self.gate_up = _param(e, hidden, 2 * inter, dtype=dtype, device=experts_at)
        self.gate_up_bias = _param(e, 2 * inter, dtype=dtype, device=device)
        self.down = _param(e, inter, hidden, dtype=dtype, device=experts_at)
        self.down_bias = _param(e, hidden, dtype=dtype, device=device)
        self.fused = use_fused
        self.fused_moe = fused_moe_kernel(torch.device(device)) if use_fused else None
        self.activation = ClampedSwiGLU(self.alpha, self.limit)
        # The weights its forward hands to the fused kernel: a quantized checkpoint's may stay so.
        self.quantized_experts = ("gate_up", "down") if use_fused else ()
        # The down bias is whole on every rank: added on one, so the sum over the ranks has it once.
        self.no_down_bias = torch.zeros(e, hidden, dtype=dtype, device=device) if self.tp.rank else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (weights, expert ids): the top-k router logits, softmaxed among themselves."""
        top, ids = torch.topk(F.linear(x, self.router_weight, self.router_bias), self.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_moe is not None:
            return self.forward_fused(x, self.fused_moe)
        weights, ids = self.route(x)
        k = ids.shape[1]
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // k  # the token each sorted assignment came from
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        sorted_x = x[token_of]
        out = torch.empty_like(sorted_x)
        # The down bias is whole on every rank: added on one, so the sum over the ranks has it once.
        with_bias = self.tp.rank == 0
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate_up = sorted_x[rows] @ self.gate_up[expert] + self.gate_up_bias[expert]
            h = self.activation(gate_up) @ self.down[expert]
            out[rows] = h + self.down_bias[expert] if with_bias else h
            start += count
        weighted = (out * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, token_of, weighted))

    def forward_fused(self, x: torch.Tensor, fused_moe: Callable[..., torch.Tensor]) -> torch.Tensor:
        weights, ids = self.route(x)
        down_bias = self.down_bias if self.no_down_bias is None else self.no_down_bias
        out = fused_moe(
            x,
            _kernel_weight(self.gate_up),
            _kernel_weight(self.down),
            weights,
            ids,
            activation=self.activation,
            b13=self.gate_up_bias,
            b2=down_bias,
        )
        return self.tp.all_reduce(out)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        e, start, inter = self.num_experts, self.inter_start, self.intermediate_size
        # (gate and up columns interleave, so a rank's slice of both is one range of 2 * inter)
        gate_up_cols = ((2 * start, 2 * inter),)
        return {
            f"{prefix}router.weight": (self.router_weight, 0, e),
            f"{prefix}router.bias": (self.router_bias, 0, e),
            f"{prefix}experts.gate_up_proj": (self.gate_up, 0, e, Shard(2, gate_up_cols)),
            f"{prefix}experts.gate_up_proj_bias": (self.gate_up_bias, 0, e, Shard(1, gate_up_cols)),
            f"{prefix}experts.down_proj": (self.down, 0, e, Shard.cols(start, inter)),
            f"{prefix}experts.down_proj_bias": (self.down_bias, 0, e),
        }


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device, mlp=GptOssExperts(spec, dtype, device))
        self.self_attn = GptOssAttention(spec, dtype, device)
        self.input_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(self, x, positions, rope, backend, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, backend, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, max_len, dtype, device)
        self.norm = GptOssRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        # The experts' token-sorted path reads each expert's token count to the host: only the
        # fused kernel's decode can be captured in a CUDA graph.
        self.supports_cuda_graphs = all(m.fused for m in self.modules() if isinstance(m, GptOssExperts))

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        return GptOssDecoderLayer(self.spec, dtype, device)

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = super().weight_slots()
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            assert isinstance(attn, GptOssAttention)  # (for the type checker)
            heads = attn.heads
            slots[f"model.layers.{i}.self_attn.sinks"] = (
                attn.sinks,
                0,
                heads.num_heads,
                Shard.rows(heads.head_start, heads.num_heads),
            )
        return slots


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Every layer sparse (routing and experts above), sliding and full layers per
    ``layer_types`` (transformers' default: even layers slide), o_proj biased with q/k/v,
    the clamped SwiGLU's constants."""
    cfg = config.values
    layers = int(cfg["num_hidden_layers"])
    return decoder_spec(
        config,
        moe=every_layer_sparse(cfg, fp32_weights=False),
        o_bias=bool(cfg.get("attention_bias", False)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        **sliding_per_layer(
            cfg, lambda: ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        ),
    )


FAMILY = Family(
    architectures=(Architecture("GptOssForCausalLM", "gpt_oss", GptOssForCausalLM),), read_config=read_config
)
