"""The KV block pool and the per-request block tables, with prefix caching.

A block holds the K/V of ``block_size`` consecutive tokens of one sequence. Blocks are
handed out on demand as a request grows, and returned the moment it finishes.

Prefix caching: a *full* block is keyed by a hash chained from its parent block's key and
its own token ids (rooted in a namespace naming the model, so different models or adapters
never share, and in the request's ``cache_salt`` when it has one, so requests of different
salts never share a block: a tenant cannot learn another's prompt from ``num_cached_tokens``
or from timing). A new request maps the longest cached prefix of its tokens onto existing
blocks (reference count +1, no recompute). A block whose count drops to zero goes to the
tail of the free queue but keeps its key, so it stays findable until it is reused for
something else: eviction is in LRU order, and a request's blocks are released tail first so
that the end of a chain is evicted before its head. Every operation is O(1) per block.

Keys are SHA-256 digests: a wrong cache hit would need a SHA-256 collision among the blocks
ever cached, which at 2**-128 birthday odds for 2**64 blocks is not a practical concern, so
tokens are not compared on a hit.

Sliding windows: when every layer of the model attends to a window, the blocks that have
fallen out of it for good are released while the request runs (``free_outside_window``). Their
ids stay in its block table, so positions still index it from 0; the attention backends never
read keys outside the window (masked, and their values are finite whoever reuses the block).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from conveyor.engine.core.request import Request
from conveyor.kernels.utils import cdiv

if TYPE_CHECKING:
    from conveyor.engine.models.model_config import ModelSpec
    from conveyor.engine.spec_decode.draft import DraftModel


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (least recently freed), append at
    the tail, and unlink from the middle when a cache hit revives a free block; all O(1)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV block")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        ids, node = [], self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """All KV blocks, their reference counts, the free queue and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block, block.block_hash)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving any that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks_in_eviction_order: list[KVBlock]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than taken")

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a just-filled block findable, unless an identical block already is."""
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash

    def _evict(self, block: KVBlock, block_hash: bytes) -> None:
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
        block.block_hash = None
        self.num_evictions += 1


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of which served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class KVCacheManager:
    """Block tables per request on top of a ``BlockPool``: the paged K/V implementation of
    ``conveyor.engine.memory.request_memory.RequestMemory``."""

    num_blocks: int
    block_size: int
    enable_caching: bool = True
    namespace: str = ""
    # When every layer of the model slides over this many tokens, the blocks that left the
    # window are released as requests run (``release_unreachable``); None: kept to the end.
    release_window: int | None = None
    # Tokens further back than the window that must stay readable (a draft model a token behind).
    window_margin: int = 0
    pool: BlockPool = field(init=False)
    stats: PrefixCacheStats = field(init=False, default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks)
        self._root_hash = hashlib.sha256(b"conveyor-kv\0" + self.namespace.encode()).digest()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        # Per request: how many of its leading blocks were released (``free_outside_window``).
        self._num_released: dict[str, int] = {}

    # ---- queries ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def block_ids(self, seq_id: str) -> list[int]:
        return self._block_ids.get(seq_id, [])

    # ---- prefix cache ---------------------------------------------------------------
    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes, bs, tokens = req.block_hashes, self.block_size, req.token_ids
        parent = hashes[-1] if hashes else self._root_of(req.params.cache_salt)
        for i in range(len(hashes), num_full_blocks):
            chunk = np.asarray(tokens[i * bs : (i + 1) * bs], dtype=np.int64).tobytes()
            parent = hashlib.sha256(parent + chunk).digest()
            hashes.append(parent)

    def _root_of(self, salt: str | None) -> bytes:
        if salt is None:
            return self._root_hash
        return hashlib.sha256(self._root_hash + b"salt\0" + salt.encode()).digest()

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``req``'s tokens: its blocks and token count.

        The last token is always left to compute: its logits are needed to sample. Whether
        the request may use them is the scheduler's call (``core.cached_prefix``)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # ---- allocation -------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        reserve_blocks: int = 0,
    ) -> bool:
        """Give ``req`` blocks for ``num_new_tokens`` more tokens (after ``computed_blocks``,
        the cache hits found at admission). False, with nothing changed, when the pool is
        short, keeping ``reserve_blocks`` free."""
        rid = req.seq_id
        blocks = self._blocks.get(rid)
        if blocks is not None and not computed_blocks:
            # The common decode step: the last block still has room and fills no new block.
            total = req.num_computed_tokens + num_new_tokens
            if total <= len(blocks) * self.block_size and (
                not self.enable_caching or total // self.block_size <= self._num_registered[rid]
            ):
                return True
        hits = computed_blocks or []
        num_computed = req.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        have = (len(blocks) if blocks else 0) + len(hits)
        need = cdiv(total, self.block_size) - have
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        if need + revived + reserve_blocks > self.pool.num_free_blocks:
            return False
        if blocks is None:
            blocks = self._blocks[rid] = []
            self._block_ids[rid] = []
            self._num_registered[rid] = 0
            if self.enable_caching:
                self.stats.queries += req.num_tokens
                self.stats.hits += len(hits) * self.block_size
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            self._num_registered[rid] = len(blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        if len(self._block_ids[rid]) != len(blocks):
            self._block_ids[rid] = [b.block_id for b in blocks]
        if self.enable_caching:
            # Only verified tokens (``token_ids``) are hashed: a step may also compute proposed
            # tokens (speculative decoding) that a rejection later overwrites.
            self._register_full_blocks(req, blocks, min(total, req.num_tokens) // self.block_size)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the blocks past the first ``num_tokens`` tokens of ``req`` (the blocks that a
        rejection of proposed tokens left empty), tail first. Registered blocks are never past
        them: they only ever hold verified tokens."""
        blocks = self._blocks.get(req.seq_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        assert self._num_registered[req.seq_id] <= keep
        self.pool.free(blocks[keep:][::-1])
        del blocks[keep:]
        del self._block_ids[req.seq_id][keep:]

    def _register_full_blocks(self, req: Request, blocks: list[KVBlock], num_full: int) -> None:
        # Registered when scheduled, before the step runs: a request admitted later in the same
        # step may hit these blocks, which is sound because every layer writes the step's K/V
        # into the cache before any attention of that layer reads it.
        start = self._num_registered[req.seq_id]
        if num_full <= start:
            return
        self._extend_hashes(req, num_full)
        for i in range(start, num_full):
            self.pool.register(blocks[i], req.block_hashes[i])
        self._num_registered[req.seq_id] = num_full

    def free_outside_window(self, req: Request, window: int) -> int:
        """Release ``req``'s leading blocks that no token from ``num_computed_tokens`` on can
        attend to with a ``window`` (its keys start at ``num_computed_tokens - window + 1``);
        returns how many. Only for a model whose every layer slides, and only while the
        computed tokens never go back (a preempted request is freed and recomputed whole)."""
        rid = req.seq_id
        blocks = self._blocks.get(rid)
        if not blocks:
            return 0
        released = self._num_released.get(rid, 0)
        first_needed = min(max(0, req.num_computed_tokens - window + 1) // self.block_size, len(blocks))
        if first_needed <= released:
            return 0
        self.pool.free(blocks[released:first_needed][::-1])
        self._num_released[rid] = first_needed
        return first_needed - released

    def release_unreachable(self, reqs: list[Request], num_uncertain: dict[str, int]) -> None:
        """After a step advanced ``reqs``' computed tokens: with a sliding window, release the
        blocks that neither the tokens that surely stay (all but the last ``num_uncertain[seq_id]``,
        proposals that may be rolled back) nor ``window_margin`` more can still attend to."""
        if self.release_window is None:
            return
        for req in reqs:
            self.free_outside_window(req, self.release_window + num_uncertain.get(req.seq_id, 0) + self.window_margin)

    def free(self, req: Request) -> None:
        blocks = self._blocks.pop(req.seq_id, None)
        self._block_ids.pop(req.seq_id, None)
        self._num_registered.pop(req.seq_id, None)
        released = self._num_released.pop(req.seq_id, 0)
        if blocks:
            self.pool.free(blocks[released:][::-1])


def window_release(model_spec: ModelSpec, model_impl: str, draft: DraftModel | None) -> tuple[int | None, int]:
    """``KVCacheManager``'s ``release_window`` and ``window_margin`` for a model: when every
    layer of a native model slides (Mistral), blocks that left the window are released as
    requests run; with a draft model only if the draft's every layer slides too, no further
    back, and one token more (the draft may be a token behind the target)."""
    window = model_spec.sliding_window if model_impl == "native" and model_spec.sliding_layers is None else None
    if draft is None:
        return window, 0
    return (window, 1) if draft.reaches_no_further_than(window) else (None, 0)
