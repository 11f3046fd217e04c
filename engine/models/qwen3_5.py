"""Qwen3.5 and Qwen3.5-MoE text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``):
hybrid models whose layers are gated DeltaNet linear attention (``GatedDeltaNet``, three of four
in released checkpoints) or gated full attention (``GatedAttention``), each following
transformers' modules:

- norms are zero-centred: ``x_normed * (1 + weight)`` in float32 (the layers', the final one,
  and the attention's per-head q/k norms), as Gemma's;
- full attention: ``q_proj`` gives each head's query and an output gate side by side; the
  output is ``attention * sigmoid(gate)``; partial rotary (the first ``rotary_dim`` dims; the
  multimodal sections of its interleaved RoPE coincide for text, where the three position ids
  are equal);
- linear attention: ``in_proj_qkv`` through a causal depthwise conv1d and SiLU, q and k
  L2-normalised, ``beta = sigmoid(b)``, the log decay ``g = -exp(A_log) * softplus(a +
  dt_bias)``, the gated delta rule (``kernels.gated_delta``), then an RMSNorm gated by
  ``silu(z)`` and ``out_proj``. Its state lives in ``engine.state_cache`` slots;
- the feed-forward block: a SiLU MLP, or (MoE) ``engine.models.moe.SparseMoE`` with its
  softmax top-k router renormalised and a sigmoid-gated shared expert.

Prefill chunks run the chunked delta rule, from each request's state (zero at its first chunk);
decodes run the recurrent form batched; both through ``GatedDeltaNet.delta``: the torch references
(one request at a time for prefills) or, on CUDA, the Triton kernels (``kernels.gated_delta_triton``,
one launch for all the step's prefills, one for its decodes). The step's state slots are read
from the block tables on the device, so decode needs no host data beyond the attention
backend's and is captured in CUDA graphs; the per-request conv loop of prefills reads them once
per step.

Speculative decoding: a verification (a decode and its proposals) runs as a prefill of ``1 + k``
rows, which, with the state cache's snapshots, also leaves the conv and recurrent state after
each of its rows (``kernels.gated_delta``'s rule); ``HybridMemory.trim`` takes the one after the
last accepted token back into the slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.distributed import parallel_state
from engine.distributed.sharding import WeightSlot
from engine.models.gemma import GemmaRMSNorm
from engine.models.hybrid_config import LinearAttentionSpec
from engine.models.llama import MLP, Attention, DecoderLayer, FeedForward, LlamaForCausalLM, _param
from engine.models.model_config import ModelSpec
from engine.models.moe import SparseMoE
from engine.state_cache import LinearStateCache
from kernels import gated_delta, reference


@dataclass
class LinearStep:
    """One step's requests as the linear layers see them: the first ``num_decodes`` have one
    token each; every request's state slot, whether it starts from a zero state, and its rows."""

    num_decodes: int
    slots: torch.Tensor  # [num_seqs] int64, on the device
    fresh: torch.Tensor  # [num_seqs] bool: its first computed token is in this step
    slots_host: list[int]  # prefills' (decodes' are not read on the host)
    fresh_host: list[bool]  # prefills'
    query_lens: list[int]
    # The prefills' rows: prefill ``b`` on rows ``prefill_starts[b]:prefill_starts[b + 1]`` after
    # the decodes' (int32, on the device; None in a decode-only step).
    prefill_starts: torch.Tensor | None
    # The prefills' first positions, for the snapshots (on the host, and on the device or None).
    prefill_positions_host: list[int] | None = None
    prefill_positions: torch.Tensor | None = None


def linear_step(backend: AttentionBackend, state: LinearStateCache) -> LinearStep:
    """The step's slots and fresh flags, computed on the device from the backend's metadata (a
    captured decode graph replays them): a row with no context (a graph's padding) gets the
    padding slot. Prefills' slots and flags are read on the host too, for the conv's loop."""
    meta = backend.meta  # (set by every backend's ``prepare``)
    seq_lens = meta.seq_lens.long()
    first_blocks = state.slot_of_block[meta.block_tables[:, 0].long()]
    slots = torch.where(seq_lens > 0, first_blocks, state.padding_slot)
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    fresh = seq_lens - query_lens <= 0  # its first computed token is in this step (padding: too)
    nd = meta.num_decodes
    prefill_lens = meta.query_lens_host[nd:]
    if not prefill_lens:
        return LinearStep(nd, slots, fresh, [-1] * nd, [False] * nd, meta.query_lens_host, None)
    starts = [s - q for s, q in zip(meta.seq_lens_host, meta.query_lens_host, strict=True)]
    bounds = [0] * (len(prefill_lens) + 1)
    for b, n in enumerate(prefill_lens):
        bounds[b + 1] = bounds[b] + n
    return LinearStep(
        num_decodes=nd,
        slots=slots,
        fresh=fresh,
        slots_host=[-1] * nd + slots[nd:].tolist(),
        fresh_host=[s == 0 for s in starts],
        query_lens=meta.query_lens_host,
        prefill_starts=torch.tensor(bounds, dtype=torch.int32, device=slots.device),
        prefill_positions_host=starts[nd:],
        prefill_positions=(seq_lens - query_lens)[nd:],
    )


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``RMSNormGated``: normalised in float32, times the weight in the input
    dtype, times ``silu(gate)`` in float32, rounded once."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedAttention(Attention):
    """Full attention with an output gate: ``q_proj`` rows hold, per head, the query then the gate."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        # The fused qkv of Llama, with each head's gate rows beside its query rows.
        self.qkv_weight = _param(2 * self.q_size + 2 * self.kv_size, spec.hidden_size, dtype=dtype, device=device)
        self.q_norm = self.k_norm = None  # (Llama's; these zero-centred ones replace them)
        self.gated_q_norm = GemmaRMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device)
        self.gated_k_norm = GemmaRMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device)

    def forward(self, x, positions, rope, backend: AttentionBackend, kv_cache):
        qkv = F.linear(x, self.qkv_weight)
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(-1, self.q_size)
        q = self.gated_q_norm(q)
        k = self.gated_k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = backend.forward(q.contiguous(), k.contiguous(), v, kv_cache[0], kv_cache[1], self.scale)
        return F.linear(out.reshape(-1, self.q_size) * torch.sigmoid(gate), self.o_weight)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; ``layer_state`` is its (conv, recurrent) slot tensors."""

    # The decodes' conv and the gated delta rule over the step's slots: ``kernels.gated_delta``
    # (the torch references) or ``kernels.gated_delta_triton`` (``use_kernel_ops``).
    delta: ModuleType = gated_delta

    def __init__(self, spec: ModelSpec, lin: LinearAttentionSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.lin, self.eps = lin, spec.rms_norm_eps
        hidden, heads = spec.hidden_size, lin.num_v_heads
        self.in_proj_qkv = _param(lin.conv_dim, hidden, dtype=dtype, device=device)
        self.in_proj_z = _param(lin.value_dim, hidden, dtype=dtype, device=device)
        self.in_proj_b = _param(heads, hidden, dtype=dtype, device=device)
        self.in_proj_a = _param(heads, hidden, dtype=dtype, device=device)
        self.conv_weight = _param(lin.conv_dim, 1, lin.conv_kernel, dtype=dtype, device=device)
        self.dt_bias = _param(heads, dtype=dtype, device=device)
        self.A_log = _param(heads, dtype=dtype, device=device)
        self.norm_weight = _param(lin.v_head_dim, dtype=dtype, device=device)
        self.out_proj = _param(hidden, lin.value_dim, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        step: LinearStep,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
        conv_snapshots: torch.Tensor | None = None,
        recurrent_snapshots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        lin = self.lin
        mixed = F.linear(x, self.in_proj_qkv)
        z = F.linear(x, self.in_proj_z)
        beta = torch.sigmoid(F.linear(x, self.in_proj_b))
        g = -self.A_log.float().exp() * F.softplus(F.linear(x, self.in_proj_a).float() + self.dt_bias)
        weight = self.conv_weight[:, 0]
        out = torch.empty(x.shape[0], lin.num_v_heads, lin.v_head_dim, dtype=x.dtype, device=x.device)
        nd = step.num_decodes
        if nd:
            slots = step.slots[:nd]
            conv_out = self.delta.causal_conv1d_update(mixed[:nd], weight, conv, slots, step.fresh[:nd])
            q, k, v = self._heads(conv_out)
            self.delta.gated_delta_decode(q, k, v, g[:nd], beta[:nd], recurrent, slots, step.fresh[:nd], out[:nd])
        if step.prefill_starts is not None:
            conv_out = torch.empty_like(mixed[nd:])
            row = 0
            for b in range(nd, len(step.query_lens)):
                rows, slot = slice(row, row + step.query_lens[b]), step.slots_host[b]
                row = rows.stop
                conv_state = torch.zeros_like(conv[slot]) if step.fresh_host[b] else conv[slot]
                if conv_snapshots is not None and step.prefill_positions_host is not None:
                    position = step.prefill_positions_host[b - nd]
                    gated_delta.causal_conv1d_snapshots(mixed[nd:][rows], conv_state, conv_snapshots, slot, position)
                conv_out[rows], conv[slot] = gated_delta.causal_conv1d(mixed[nd:][rows], weight, conv_state)
            q, k, v = self._heads(conv_out)
            self.delta.gated_delta_prefill(
                q, k, v, g[nd:], beta[nd:], recurrent, step.prefill_starts, step.slots[nd:], step.fresh[nd:], out[nd:],
                snapshots=recurrent_snapshots, positions=step.prefill_positions,
            )  # fmt: skip
        normed = gated_rms_norm(out, z.view_as(out), self.norm_weight, self.eps)
        return F.linear(normed.reshape(x.shape[0], lin.value_dim), self.out_proj)

    def use_kernel_ops(self, ops: ModuleType) -> None:
        """Run the Triton gated delta kernels where the model runs the Triton ops
        (``engine.models.llama.kernel_ops``'s choice), the torch references elsewhere."""
        if ops is reference:
            self.delta = gated_delta
        else:
            from kernels import gated_delta_triton  # imports Triton: only where it is wanted

            self.delta = gated_delta_triton

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output as float32 q (normalised and scaled) and k (normalised), ``[tokens,
        k heads, dk]``, and v, ``[tokens, v heads, dv]`` (each key head serves ``v heads / k
        heads`` value heads)."""
        lin = self.lin
        q, k, v = mixed.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        q = gated_delta.l2_normalise(q.float().view(-1, lin.num_k_heads, lin.k_head_dim)) * lin.k_head_dim**-0.5
        k = gated_delta.l2_normalise(k.float().view(-1, lin.num_k_heads, lin.k_head_dim))
        return q, k, v.view(-1, lin.num_v_heads, lin.v_head_dim)


class HybridLayer(DecoderLayer):
    """A mixer (``self_attn``: ``GatedAttention`` or ``GatedDeltaNet``) then the feed-forward
    block, each behind a zero-centred norm and a residual add."""

    def __init__(self, spec: ModelSpec, mixer: nn.Module, mlp: FeedForward, dtype, device) -> None:
        nn.Module.__init__(self)  # (DecoderLayer's own init builds Llama's attention)
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = mixer  # type: ignore[assignment]
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(self, x, mix):  # type: ignore[override]
        x = x + mix(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    # A decode step reads its state slots and fresh flags on the device (``linear_step``).
    supports_cuda_graphs = True

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        if spec.linear_attention is None:
            raise ValueError(f"{spec.architecture} needs the config's linear-attention fields")
        if parallel_state.current().enabled:
            raise ValueError(
                f"{spec.architecture} is not served under tensor parallelism: its linear-attention layers' "
                "state and heads are not split over ranks; run it with tensor_parallel_size=1"
            )
        self.lin = spec.linear_attention
        super().__init__(spec, max_len, dtype, device)
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        # Which layers read the paged KV cache (the runner allocates KV for these only).
        self.kv_layers = [i for i, linear in enumerate(self.lin.linear_layers) if not linear]
        self.state: LinearStateCache | None = None

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        spec = self.spec
        mixer: nn.Module = (
            GatedDeltaNet(spec, self.lin, dtype, device)
            if self.lin.linear_layers[index]
            else GatedAttention(spec, dtype, device)
        )
        return HybridLayer(spec, mixer, self.make_mlp(dtype, device), dtype, device)

    def make_mlp(self, dtype: torch.dtype, device: torch.device) -> FeedForward:
        return MLP(self.spec, dtype, device)

    # ---- the per-request state (``engine.state_cache``) -------------------------------
    def state_bytes_per_seq(self, num_snapshots: int = 0) -> int:
        return (1 + num_snapshots) * self.lin.state_bytes(self.embed_tokens.element_size())

    def allocate_state(self, num_slots: int, num_blocks: int, num_snapshots: int = 0) -> LinearStateCache:
        self.state = LinearStateCache.allocate(
            self.lin, num_slots, num_blocks, self.embed_tokens.dtype, self.embed_tokens.device, num_snapshots
        )
        return self.state

    @torch.inference_mode()
    def forward(self, input_ids, positions, backend: AttentionBackend, kv_caches) -> torch.Tensor:
        state = self.state
        if state is None:
            raise RuntimeError("allocate_state() must run before the first step")
        step = linear_step(backend, state)
        x = self.embed(input_ids)
        kv_iter, linear_index = iter(kv_caches), 0
        for layer in self.layers:
            mixer = layer.self_attn
            if isinstance(mixer, GatedDeltaNet):
                i = linear_index
                linear_index += 1
                x = layer(x, lambda h, m=mixer, i=i: m(h, step, state.conv[i], state.recurrent[i], *state.snapshots(i)))
            else:
                kv = next(kv_iter)
                x = layer(x, lambda h, m=mixer, kv=kv: m(h, positions, self.rope, backend, kv))
        return self.norm(x)

    # ---- loading ------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """A multimodal checkpoint's language-model tensor under the text model's name; None
        for the vision tower's and the multi-token-prediction head's, which are not used."""
        if name.startswith(("model.visual.", "mtp.")):
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model.") :]
        return name

    def weight_slots(self) -> dict[str, WeightSlot]:
        spec, vocab, h = self.spec, self.vocab, self.spec.hidden_size
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, vocab.rows),
            "model.norm.weight": (self.norm.weight, 0, h),
        }
        if not spec.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0, vocab.rows)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, HybridLayer)  # (a ModuleList types its items as Module)
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0, h)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, h)
            mixer = layer.self_attn
            if isinstance(mixer, GatedDeltaNet):
                lin = self.lin
                for name, tensor, rows in (
                    ("in_proj_qkv.weight", mixer.in_proj_qkv, lin.conv_dim),
                    ("in_proj_z.weight", mixer.in_proj_z, lin.value_dim),
                    ("in_proj_b.weight", mixer.in_proj_b, lin.num_v_heads),
                    ("in_proj_a.weight", mixer.in_proj_a, lin.num_v_heads),
                    ("conv1d.weight", mixer.conv_weight, lin.conv_dim),
                    ("dt_bias", mixer.dt_bias, lin.num_v_heads),
                    ("A_log", mixer.A_log, lin.num_v_heads),
                    ("norm.weight", mixer.norm_weight, lin.v_head_dim),
                    ("out_proj.weight", mixer.out_proj, h),
                ):
                    slots[f"{p}linear_attn.{name}"] = (tensor, 0, rows)
            else:
                a = mixer
                assert isinstance(a, GatedAttention)
                q2, kv = 2 * a.q_size, a.kv_size
                slots[p + "self_attn.q_proj.weight"] = (a.qkv_weight, 0, q2)
                slots[p + "self_attn.k_proj.weight"] = (a.qkv_weight, q2, kv)
                slots[p + "self_attn.v_proj.weight"] = (a.qkv_weight, q2 + kv, kv)
                slots[p + "self_attn.o_proj.weight"] = (a.o_weight, 0, h)
                slots[p + "self_attn.q_norm.weight"] = (a.gated_q_norm.weight, 0, spec.head_dim)
                slots[p + "self_attn.k_norm.weight"] = (a.gated_k_norm.weight, 0, spec.head_dim)
            slots.update(layer.mlp.weight_slots(p + "mlp."))
        return slots


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's feed-forward block is a ``SparseMoE`` with a gated shared expert."""

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, max_len, dtype, device)
        # As for the other MoE models: the token-sorted path reads expert counts on the host.
        self.supports_cuda_graphs = all(m.fused for m in self.modules() if isinstance(m, SparseMoE))

    def make_mlp(self, dtype: torch.dtype, device: torch.device) -> FeedForward:
        moe = self.spec.moe
        if moe is None:
            raise ValueError(f"{self.spec.architecture} needs the config's mixture-of-experts fields")
        return SparseMoE(self.spec, moe, ("gate_proj", "up_proj", "down_proj"), dtype, device)
