"""Qwen3.5 and Qwen3.5-MoE text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) and
Qwen3-Next (``Qwen3NextForCausalLM``: the same layers, its linear projections fused per key head):
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
  dt_bias)``, the gated delta rule (``conveyor.kernels.gated_delta``), then an RMSNorm gated by
  ``silu(z)`` and ``out_proj``. Its state lives in ``conveyor.engine.state_cache`` slots;
- the feed-forward block: a SiLU MLP, or (MoE) ``conveyor.engine.models.moe.SparseMoE`` with its
  softmax top-k router renormalised and a sigmoid-gated shared expert.

Prefill chunks run the chunked delta rule, from each request's state (zero at its first chunk);
decodes run the recurrent form batched; both through ``GatedDeltaNet.delta``: the torch references
(one request at a time for prefills) or, on CUDA, the Triton kernels (``conveyor.kernels.gated_delta_triton``,
one launch for all the step's prefills, one for its decodes). The step's state slots are read
from the block tables on the device, so decode needs no host data beyond the attention
backend's and is captured in CUDA graphs; the per-request conv loop of prefills reads them once
per step.

Under tensor parallelism a linear layer holds its rank's key heads and the value heads grouped
with them (``LinearAttentionSpec.rank_share``), and its state slots those heads' state; the
full attention splits its heads and the feed-forward block its intermediate dim, as Llama's.

Speculative decoding: a verification (a decode and its proposals) runs as a prefill of ``1 + k``
rows, which, with the state cache's snapshots, also leaves the conv and recurrent state after
each of its rows (``conveyor.kernels.gated_delta``'s rule); ``HybridMemory.trim`` takes the one after the
last accepted token back into the slot.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.parallel_state import ParallelState
from conveyor.engine.distributed.sharding import Shard, WeightSlot
from conveyor.engine.memory.state_cache import LinearStateCache
from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.gemma import GemmaRMSNorm
from conveyor.engine.models.hybrid_config import LinearAttentionSpec, text_model_config
from conveyor.engine.models.layers import MLP, Attention, DecoderLayer, FeedForward, _param
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, MoESpec, decoder_spec
from conveyor.engine.models.moe import SparseMoE, qwen_moe
from conveyor.kernels import gated_delta, reference


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


def linear_step(
    backend: AttentionBackend, state: LinearStateCache, tp: ParallelState = parallel_state.SINGLE
) -> LinearStep:
    """The step's slots and fresh flags, computed on the device from the backend's metadata (a
    captured decode graph replays them): a row with no context (a graph's padding) gets the
    padding slot. Prefills' slots and flags are read on the host too, for the conv's loop.
    Under tensor parallelism rank 0's memory manager binds the slots (``HybridMemory``): the
    other ranks take the step's slots from it, one broadcast a step."""
    meta = backend.meta  # (set by every backend's ``prepare``)
    seq_lens = meta.seq_lens.long()
    first_blocks = state.slot_of_block[meta.block_tables[:, 0].long()]
    slots = tp.broadcast(torch.where(seq_lens > 0, first_blocks, state.padding_slot))
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
        return self.tp.row_parallel_linear(out.reshape(-1, self.q_size) * torch.sigmoid(gate), self.o_weight, None)

    def weight_slots(self, prefix: str, head_dim: int) -> dict[str, WeightSlot]:
        """``q_proj``/``k_proj``/``v_proj``/``o_proj`` and the q/k norms under ``prefix``; under
        tensor parallelism this rank's heads (``q_proj`` holds each head's query and gate side by
        side, so a head's rows are ``2 * head_dim``)."""
        heads, d, q2, kv = self.heads, head_dim, 2 * self.q_size, self.kv_size
        return {
            prefix + "q_proj.weight": (self.qkv_weight, 0, q2, Shard.rows(heads.head_start * 2 * d, q2)),
            prefix + "k_proj.weight": (self.qkv_weight, q2, kv, Shard.rows(heads.kv_head_start * d, kv)),
            prefix + "v_proj.weight": (self.qkv_weight, q2 + kv, kv, Shard.rows(heads.kv_head_start * d, kv)),
            prefix + "o_proj.weight": (
                self.o_weight,
                0,
                self.o_weight.shape[0],
                Shard.cols(heads.head_start * d, self.q_size),
            ),
            prefix + "q_norm.weight": (self.gated_q_norm.weight, 0, d),
            prefix + "k_norm.weight": (self.gated_k_norm.weight, 0, d),
        }


class GatedDeltaNet(nn.Module):
    """A linear-attention layer; ``layer_state`` is its (conv, recurrent) slot tensors. Under
    tensor parallelism it holds this rank's key heads and the value heads grouped with them
    (``LinearAttentionSpec.rank_share``), and ``out_proj``'s partial outputs are summed."""

    # The decodes' conv and the gated delta rule over the step's slots: ``conveyor.kernels.gated_delta``
    # (the torch references) or ``conveyor.kernels.gated_delta_triton`` (``use_kernel_ops``).
    delta: ModuleType = gated_delta

    def __init__(self, spec: ModelSpec, lin: LinearAttentionSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tp = parallel_state.current()
        self.full = lin  # the model's shapes (the checkpoint's); ``lin``: this rank's
        self.lin = lin = lin.rank_share(self.tp.world_size)
        self.eps = spec.rms_norm_eps
        hidden, heads = spec.hidden_size, lin.num_v_heads
        self.make_projections(hidden, dtype, device)
        self.conv_weight = _param(lin.conv_dim, 1, lin.conv_kernel, dtype=dtype, device=device)
        self.dt_bias = _param(heads, dtype=dtype, device=device)
        self.A_log = _param(heads, dtype=dtype, device=device)
        self.norm_weight = _param(lin.v_head_dim, dtype=dtype, device=device)
        self.out_proj = _param(hidden, lin.value_dim, dtype=dtype, device=device)

    def make_projections(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        lin = self.lin
        self.in_proj_qkv = _param(lin.conv_dim, hidden, dtype=dtype, device=device)
        self.in_proj_z = _param(lin.value_dim, hidden, dtype=dtype, device=device)
        self.in_proj_b = _param(lin.num_v_heads, hidden, dtype=dtype, device=device)
        self.in_proj_a = _param(lin.num_v_heads, hidden, dtype=dtype, device=device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's input (q, k, v channels), ``z`` (``[tokens, value_dim]``), and ``b``
        and ``a`` (``[tokens, v heads]``)."""
        return (
            F.linear(x, self.in_proj_qkv),
            F.linear(x, self.in_proj_z),
            F.linear(x, self.in_proj_b),
            F.linear(x, self.in_proj_a),
        )

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
        mixed, z, beta_logits, decay_in = self.project(x)
        beta = torch.sigmoid(beta_logits)
        g = -self.A_log.float().exp() * F.softplus(decay_in.float() + self.dt_bias)
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
        return self.tp.row_parallel_linear(normed.reshape(x.shape[0], lin.value_dim), self.out_proj, None)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        """Its checkpoint tensors under ``prefix``, each with the ``Shard`` of this rank's heads:
        the q, k and v channels of ``in_proj_qkv`` and of the conv (one range from each part),
        the value heads' rows of ``in_proj_z``/``in_proj_b``/``in_proj_a``, ``dt_bias`` and
        ``A_log``, and ``out_proj``'s matching columns. The gated norm's weight, one head's, is
        whole on every rank."""
        full, lin, rank = self.full, self.lin, self.tp.rank
        k_start, v_start = rank * lin.num_k_heads, rank * lin.num_v_heads
        dk, dv = lin.k_head_dim, lin.v_head_dim
        channels = Shard(
            0,
            (
                (k_start * dk, lin.key_dim),  # q
                (full.key_dim + k_start * dk, lin.key_dim),  # k
                (2 * full.key_dim + v_start * dv, lin.value_dim),  # v
            ),
        )
        heads = Shard.rows(v_start, lin.num_v_heads)
        slots: dict[str, WeightSlot] = {
            **self.projection_slots(channels, k_start, v_start),
            "conv1d.weight": (self.conv_weight, 0, lin.conv_dim, channels),
            "dt_bias": (self.dt_bias, 0, lin.num_v_heads, heads),
            "A_log": (self.A_log, 0, lin.num_v_heads, heads),
            "norm.weight": (self.norm_weight, 0, dv),
            "out_proj.weight": (self.out_proj, 0, self.out_proj.shape[0], Shard.cols(v_start * dv, lin.value_dim)),
        }
        return {prefix + name: slot for name, slot in slots.items()}

    def projection_slots(self, channels: Shard, k_start: int, v_start: int) -> dict[str, WeightSlot]:
        lin = self.lin
        values, heads = Shard.rows(v_start * lin.v_head_dim, lin.value_dim), Shard.rows(v_start, lin.num_v_heads)
        return {
            "in_proj_qkv.weight": (self.in_proj_qkv, 0, lin.conv_dim, channels),
            "in_proj_z.weight": (self.in_proj_z, 0, lin.value_dim, values),
            "in_proj_b.weight": (self.in_proj_b, 0, lin.num_v_heads, heads),
            "in_proj_a.weight": (self.in_proj_a, 0, lin.num_v_heads, heads),
        }

    def use_kernel_ops(self, ops: ModuleType) -> None:
        """Run the Triton gated delta kernels where the model runs the Triton ops
        (``conveyor.engine.models.llama.kernel_ops``'s choice), the torch references elsewhere."""
        if ops is reference:
            self.delta = gated_delta
        else:
            from conveyor.kernels import gated_delta_triton  # imports Triton: only where it is wanted

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


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's linear-attention layer: ``GatedDeltaNet`` with its projections fused as
    transformers' ``Qwen3NextGatedDeltaNet`` has them, grouped by key head: ``in_proj_qkvz`` holds,
    per key head, its q, its k, then the v and z of its ``num_v_heads // num_k_heads`` value
    heads; ``in_proj_ba`` the b then the a of those value heads. A rank's key heads are one
    range of rows of each."""

    def make_projections(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        lin = self.lin
        self.in_proj_qkvz = _param(lin.conv_dim + lin.value_dim, hidden, dtype=dtype, device=device)
        self.in_proj_ba = _param(2 * lin.num_v_heads, hidden, dtype=dtype, device=device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lin, n = self.lin, x.shape[0]
        dk, vz = lin.k_head_dim, lin.value_dim // lin.num_k_heads  # (a key head's value heads' width)
        q, k, v, z = F.linear(x, self.in_proj_qkvz).view(n, lin.num_k_heads, -1).split([dk, dk, vz, vz], dim=-1)
        b, a = F.linear(x, self.in_proj_ba).view(n, lin.num_k_heads, -1).chunk(2, dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, -1), b.reshape(n, -1), a.reshape(n, -1)

    def projection_slots(self, channels: Shard, k_start: int, v_start: int) -> dict[str, WeightSlot]:
        lin = self.lin
        qkvz, ba = lin.conv_dim + lin.value_dim, 2 * lin.num_v_heads  # (this rank's rows)
        return {
            "in_proj_qkvz.weight": (self.in_proj_qkvz, 0, qkvz, Shard.rows(k_start * qkvz // lin.num_k_heads, qkvz)),
            "in_proj_ba.weight": (self.in_proj_ba, 0, ba, Shard.rows(k_start * ba // lin.num_k_heads, ba)),
        }


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
    # Its linear-attention layers (Qwen3-Next's fuse their projections otherwise).
    linear_mixer: type[GatedDeltaNet] = GatedDeltaNet
    # A decode step reads its state slots and fresh flags on the device (``linear_step``).
    supports_cuda_graphs = True

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        if spec.linear_attention is None:
            raise ValueError(f"{spec.architecture} needs the config's linear-attention fields")
        self.linear_spec = spec.linear_attention  # the checkpoint's shapes
        # This rank's linear-attention heads (all of them at world size 1): its state slots hold those only.
        self.lin = spec.linear_attention.rank_share(parallel_state.current().world_size)
        super().__init__(spec, max_len, dtype, device)
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        # Which layers read the paged KV cache (the runner allocates KV for these only).
        self.kv_layers = [i for i, linear in enumerate(self.lin.linear_layers) if not linear]
        self.state: LinearStateCache | None = None

    def make_layer(self, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        spec = self.spec
        mixer: nn.Module = (
            self.linear_mixer(spec, self.linear_spec, dtype, device)
            if self.lin.linear_layers[index]
            else GatedAttention(spec, dtype, device)
        )
        return HybridLayer(spec, mixer, self.make_mlp(index, dtype, device), dtype, device)

    def make_mlp(self, index: int, dtype: torch.dtype, device: torch.device) -> FeedForward:
        return MLP(self.spec, dtype, device)

    # ---- the per-request state (``conveyor.engine.state_cache``) -------------------------------
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
        step = linear_step(backend, state, self.tp)
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
        rows = Shard.rows(vocab.start, vocab.rows)  # (this rank's vocabulary rows)
        slots: dict[str, WeightSlot] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, vocab.rows, rows),
            "model.norm.weight": (self.norm.weight, 0, h),
        }
        if not spec.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, 0, vocab.rows, rows)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, HybridLayer)  # (a ModuleList types its items as Module)
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0, h)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, h)
            mixer = layer.self_attn
            if isinstance(mixer, GatedDeltaNet):
                slots.update(mixer.weight_slots(p + "linear_attn."))
            else:
                assert isinstance(mixer, GatedAttention)
                slots.update(mixer.weight_slots(p + "self_attn.", spec.head_dim))
            slots.update(layer.mlp.weight_slots(p + "mlp."))
        return slots


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's feed-forward block is a ``SparseMoE`` with a gated shared expert."""

    def __init__(self, spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, max_len, dtype, device)
        # As for the other MoE models: the token-sorted path reads expert counts on the host.
        self.supports_cuda_graphs = all(m.fused for m in self.modules() if isinstance(m, SparseMoE))

    def make_mlp(self, index: int, dtype: torch.dtype, device: torch.device) -> FeedForward:
        moe = self.spec.moe
        if moe is None:
            raise ValueError(f"{self.spec.architecture} needs the config's mixture-of-experts fields")
        return SparseMoE(self.spec, moe, ("gate_proj", "up_proj", "down_proj"), dtype, device)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next (``Qwen3NextForCausalLM``), the hybrid before Qwen3.5: the same layers, its
    linear attention's projections fused (``FusedGatedDeltaNet``), and, as Qwen2-MoE, dense
    MLP layers where the config says (``mlp_only_layers``, ``decoder_sparse_step``)."""

    linear_mixer = FusedGatedDeltaNet

    def make_mlp(self, index: int, dtype: torch.dtype, device: torch.device) -> FeedForward:
        moe = self.spec.moe
        if moe is None or index not in moe.sparse_layers:
            return MLP(self.spec, dtype, device)
        return super().make_mlp(index, dtype, device)


def read_config(config: CheckpointConfig) -> ModelSpec:
    """Which layers are linear attention, and their shapes; Qwen3.5-MoE's every layer sparse,
    renormalised, with a gated shared expert; Qwen3-Next's sparse layers as Qwen2-MoE's."""
    cfg = config.values
    moe: MoESpec | None = None
    if cfg["model_type"] == "qwen3_5_moe_text":
        moe = MoESpec(
            num_experts=int(cfg["num_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            renormalize=True,
            sparse_layers=tuple(range(int(cfg["num_hidden_layers"]))),
            shared_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
        )
    elif cfg["model_type"] == "qwen3_next":
        moe = qwen_moe(cfg, shared_expert=True, renormalize=True)
    return decoder_spec(config, moe=moe, linear_attention=LinearAttentionSpec.from_config(cfg))


# The multimodal Qwen3.5 checkpoints serve their language model: the vision tower's tensors
# are skipped at load (``Qwen3_5ForCausalLM.checkpoint_name``); images are not served.
FAMILY = Family(
    architectures=(
        Architecture("Qwen3_5ForCausalLM", "qwen3_5_text", Qwen3_5ForCausalLM),
        Architecture("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", Qwen3_5MoeForCausalLM),
        Architecture("Qwen3NextForCausalLM", "qwen3_next", Qwen3NextForCausalLM),
    ),
    read_config=read_config,
    wrappers={
        "qwen3_5": functools.partial(text_model_config, architecture="Qwen3_5ForCausalLM"),
        "qwen3_5_moe": functools.partial(text_model_config, architecture="Qwen3_5MoeForCausalLM"),
    },
)
