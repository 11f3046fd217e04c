"""A draft model: a smaller model with the target's tokenizer that proposes tokens greedily.

It has its own paged KV tensors with as many blocks as the target's, of the same size, and
reads and writes them through the target's block tables: a slot holds the target's K/V of a
token in the target's tensors and the draft's K/V of the same token in the draft's. Each
request's draft KV is its own computation from position 0 (a request that starts to
speculate, or comes back after preemption, has its draft catch up over its whole sequence),
so a block shared through the prefix cache is at most rewritten with the same values.

A proposal of ``k`` tokens: one pass over the tokens the draft has not seen yet (the catch-up,
ending with the request's last token) gives ``d_1``; ``k - 1`` decode passes give the rest,
batched over the requests. Accepted proposals keep the draft K/V they were fed with, so the
next catch-up starts after them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import create_backend
from engine.config import kv_block_bytes
from engine.models.loader import load_model, load_spec, load_tokenizer, resolve_model_path
from engine.models.model_config import ModelSpec
from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig


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
        self.spec, impl = load_spec(path)
        _check_same_vocabulary(config.model, self.spec, load_tokenizer(path), target_spec, target_tokenizer)
        limit = self.spec.max_position_embeddings
        if limit < max_model_len:
            raise ValueError(
                f"speculative_config.model {config.model!r} takes at most {limit} positions, fewer than the "
                f"target's max_model_len {max_model_len}; set max_model_len to at most {limit}"
            )
        self.model = load_model(path, self.spec, max_model_len, dtype, device, impl)
        self.backend = create_backend(attention_backend, device)
        self.dtype, self.device = dtype, device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        # request id -> tokens whose draft K/V is in the cache (requests no longer running are
        # dropped each step by ``keep_only``: a preempted request starts again from 0).
        self._computed: dict[str, int] = {}

    def block_bytes(self, block_size: int) -> int:
        s = self.spec
        return kv_block_bytes(s.num_layers, block_size, s.num_kv_heads, s.head_dim, self.dtype)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        s = self.spec
        shape = (s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(s.num_layers)]
        self.block_size = block_size

    def keep_only(self, running: list[Request]) -> None:
        alive = {r.request_id for r in running}
        for rid in [rid for rid in self._computed if rid not in alive]:
            del self._computed[rid]

    def accepted(self, req: Request, num_accepted: int, num_proposed: int) -> None:
        """The target accepted ``num_accepted`` of ``req``'s proposals: those the draft was fed
        (all but the last proposal) have their draft K/V at the right positions already."""
        if req.request_id in self._computed:
            self._computed[req.request_id] += min(num_accepted, num_proposed - 1)

    def propose(self, reqs: list[Request], counts: list[int], block_ids_of: Callable[[Request], list[int]]) -> None:
        """Set ``spec_token_ids`` of each request to ``counts[i]`` greedy draft tokens. Their
        slots (up to ``num_tokens + counts[i] - 1``) are allocated already."""
        tables = [block_ids_of(r) for r in reqs]
        chunks = []
        for req in reqs:
            start = self._computed.get(req.request_id, 0)
            chunks.append((start, req.token_ids[start:]))
            self._computed[req.request_id] = req.num_tokens
        first = self._forward([(s, toks) for s, toks in chunks], tables)
        proposals = [[t] for t in first]
        for step in range(1, max(counts)):
            active = [i for i, c in enumerate(counts) if c > step]
            batch = [(reqs[i].num_tokens + step - 1, [proposals[i][-1]]) for i in active]
            for i, t in zip(active, self._forward(batch, [tables[i] for i in active]), strict=True):
                proposals[i].append(t)
        for req, proposal, count in zip(reqs, proposals, counts, strict=True):
            req.spec_token_ids = proposal[:count]

    def _forward(self, chunks: list[tuple[int, list[int]]], tables: list[list[int]]) -> list[int]:
        """The greedy next token after each chunk (``(first position, tokens)``), K/V written."""
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
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=dev)])
        tokens = logits.argmax(dim=-1).tolist()
        out = [0] * len(chunks)
        for j, i in enumerate(order):
            out[i] = tokens[j]
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
