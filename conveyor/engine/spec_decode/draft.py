"""A draft model: a smaller model with the target's tokenizer that proposes tokens greedily.

It has its own paged KV tensors with as many blocks as the target's, of the same size, and
reads and writes them through the target's block tables: a slot holds the target's K/V of a
token in the target's tensors and the draft's K/V of the same token in the draft's.

The draft runs in step with the target: every step, it computes the tokens the target
computes for each scheduled request (prompt chunks as the target chunks them, plain decodes),
so it never has a whole prompt to catch up on at once, its work follows the step's token
budget, and the draft K/V of a block the prefix cache shares is there already (a request
admitted with cached tokens starts after them, as the target does). A proposal of ``k``
tokens: one pass over the tokens the draft has not seen yet (the last sampled token, and the
last accepted proposal) gives ``d_1``; ``k - 1`` decode passes give the rest, batched over
the requests. Accepted proposals keep the draft K/V they were fed with.

The draft K/V is only ever a proposal's input: where it is stale (a block cached by a request
that ended before its last token was fed to the draft), proposals are worse, never outputs.
"""

from __future__ import annotations

import torch

from conveyor.engine.attention.base import AttentionMetadata
from conveyor.engine.attention.selector import create_backend
from conveyor.engine.config import kv_block_bytes
from conveyor.engine.core.request import Request
from conveyor.engine.distributed import parallel_state
from conveyor.engine.models.loader import load_model, load_spec, load_tokenizer, resolve_model_path
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.spec_decode.config import SpeculativeConfig


class DraftModel:
    def __init__(
        self,
        config: SpeculativeConfig,
        target_spec: ModelSpec,
        target_tokenizer,
        *,
        attention_backend: str,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert config.model is not None  # SpeculativeConfig checks it for method="draft"
        path = resolve_model_path(config.model, config.revision)
        self.model_spec, impl = load_spec(path)
        if self.model_spec.linear_attention is not None:
            raise ValueError(
                f"speculative_config.model {config.model!r} is a hybrid (linear-attention) model: a draft's "
                "recurrent state is not kept; use a draft with attention layers only, or method='ngram'"
            )
        _check_same_vocabulary(config.model, self.model_spec, load_tokenizer(path), target_spec, target_tokenizer)
        limit = self.model_spec.max_position_embeddings
        if limit < max_model_len:
            raise ValueError(
                f"speculative_config.model {config.model!r} takes at most {limit} positions, fewer than the "
                f"target's max_model_len {max_model_len}; set max_model_len to at most {limit}"
            )
        self.impl = impl
        # Under tensor parallelism the draft runs whole on rank 0, next to the target's shard.
        with parallel_state.single_process():
            self.model = load_model(path, self.model_spec, max_model_len, dtype, device, impl)
        self.backend = create_backend(attention_backend, device)
        self.dtype, self.device = dtype, device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        # request id -> tokens whose draft K/V is in the cache (requests no longer running are
        # dropped each step by ``keep_only``: a preempted one starts again where the target does).
        self._computed: dict[str, int] = {}

    def reaches_no_further_than(self, window: int | None) -> bool:
        """Whether the draft's attention looks back at most ``window`` tokens on every layer
        (None: the target attends to everything, so nothing is ever out of reach)."""
        if window is None:
            return True
        w = self.model_spec.sliding_window
        return self.impl == "native" and self.model_spec.sliding_layers is None and w is not None and w <= window

    def block_bytes(self, block_size: int) -> int:
        s = self.model_spec
        return kv_block_bytes(s.kv_cache_layers, block_size, s.num_kv_heads, s.head_dim, self.dtype)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        s = self.model_spec
        shape = (s.kv_cache_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(s.kv_cache_layers)]
        self.block_size = block_size

    def keep_only(self, running: list[Request]) -> None:
        alive = {r.seq_id for r in running}
        for rid in [rid for rid in self._computed if rid not in alive]:
            del self._computed[rid]

    def accepted(self, req: Request, num_accepted: int, num_proposed: int) -> None:
        """The target accepted ``num_accepted`` of ``req``'s proposals: those the draft was fed
        (all but the last proposal) have their draft K/V at the right positions already."""
        if req.seq_id in self._computed:
            self._computed[req.seq_id] += min(num_accepted, num_proposed - 1)

    def propose(
        self,
        scheduled: list[Request],
        num_new_tokens: list[int],
        counts: dict[str, int],
        tables: list[list[int]],
    ) -> None:
        """Feed the draft this step's tokens of every ``scheduled`` request (``num_new_tokens``
        each, the target's, without proposals) and set ``spec_token_ids`` of each request in
        ``counts`` to that many greedy draft tokens. Their slots (up to ``num_tokens +
        counts[id] - 1``) are allocated already; ``tables`` are their block tables."""
        chunks = []
        proposing: list[int] = []
        for i, (req, n) in enumerate(zip(scheduled, num_new_tokens, strict=True)):
            rid, computed = req.seq_id, req.num_computed_tokens
            start = min(self._computed.get(rid, computed), computed)
            end = req.num_tokens if rid in counts else computed + n
            chunks.append((start, req.token_ids[start:end]))
            self._computed[rid] = end
            if rid in counts:
                proposing.append(i)
        if not chunks:
            return
        first = self._forward(chunks, tables, want=proposing)
        proposals = {i: [first[i]] for i in proposing}
        for step in range(1, max((counts[scheduled[i].seq_id] for i in proposing), default=0)):
            active = [i for i in proposing if counts[scheduled[i].seq_id] > step]
            batch = [(scheduled[i].num_tokens + step - 1, [proposals[i][-1]]) for i in active]
            nexts = self._forward(batch, [tables[i] for i in active], want=list(range(len(active))))
            for j, i in enumerate(active):
                proposals[i].append(nexts[j])
        for i in proposing:
            req = scheduled[i]
            req.spec_token_ids = proposals[i][: counts[req.seq_id]]

    def _forward(self, chunks: list[tuple[int, list[int]]], tables: list[list[int]], want: list[int]) -> list[int]:
        """K/V written for each chunk (``(first position, tokens)``); the greedy next token
        after each chunk listed in ``want`` (-1 for the others)."""
        # Decodes (one token) first, by context length, as the attention backends expect.
        order = sorted(range(len(chunks)), key=lambda i: (len(chunks[i][1]) != 1, chunks[i][0]))
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        for i in order:
            start, tokens = chunks[i]
            table = tables[i]
            for offset, token in enumerate(tokens):
                pos = start + offset
                ids.append(token)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            last_rows.append(len(ids) - 1)
        num_decodes = sum(1 for n in lens if n == 1)
        dev = self.device
        ordered_tables = [tables[i] for i in order]
        self.backend.prepare(AttentionMetadata.from_host(slots, ordered_tables, lens, seq_lens, num_decodes, dev))
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.backend,
            self.kv_caches,
        )
        out = [-1] * len(chunks)
        if not want:
            return out
        row_of = {i: last_rows[j] for j, i in enumerate(order)}
        rows = torch.tensor([row_of[i] for i in want], device=dev)
        tokens = self.model.compute_logits(hidden[rows]).argmax(dim=-1).tolist()
        for i, token in zip(want, tokens, strict=True):
            out[i] = token
        return out


def _check_same_vocabulary(name: str, spec: ModelSpec, tokenizer, target_spec: ModelSpec, target_tokenizer) -> None:
    if spec.vocab_size != target_spec.vocab_size:
        raise ValueError(
            f"speculative_config.model {name!r} has a vocabulary of {spec.vocab_size} tokens, the target "
            f"{target_spec.vocab_size}: a draft model must share the target's tokenizer"
        )
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_config.model {name!r} has a different tokenizer from the target's (its token ids "
            "mean other text): a draft model must share the target's tokenizer"
        )
