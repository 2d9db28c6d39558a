"""KV block bookkeeping: which physical blocks each sequence uses. Integers only, no tensors.

A fixed pool of blocks (block 0 is a permanently reserved null block that padding points at).
Blocks carry reference counts: a prefix shared by several sequences, or a fork's common past, is
stored once. Full blocks get a chained hash (parent hash, adapter key, token ids) so a later
sequence with the same prefix under the same adapters finds them; freed blocks keep their hash in
an LRU free queue until reused. A write into a shared block first copies it (copy-on-write).

The pool alone counts its blocks, each in exactly one state (`BlockState`): used by a live
sequence, cached (reusable KV nothing live holds: an idle session's kept turn or an unreferenced
prefix), or free (empty). So free + used + cached is always the total, however many sequences,
forks and sessions share a block; a session's kept blocks are marked through `keep`/`unkeep`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from enum import Enum

from libs.engine.sequence import Sequence

NULL_BLOCK = 0


class BlockState(Enum):
    FREE = "free"  # unreferenced and empty
    CACHED = "cached"  # unreferenced, holding a prefix the cache can still find
    KEPT = "kept"  # referenced by idle sessions' kept turns only (given up under pressure)
    USED = "used"  # referenced by at least one live sequence


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    kept_cnt: int = 0  # of ref_cnt, the references idle sessions' kept turns hold

    @property
    def state(self) -> BlockState:
        if self.ref_cnt == 0:
            return BlockState.FREE if self.block_hash is None else BlockState.CACHED
        return BlockState.KEPT if self.kept_cnt == self.ref_cnt else BlockState.USED


@dataclass(frozen=True)
class KVCacheUsage:
    """One partition of the usable blocks: num_free + num_used + num_cached == num_blocks."""

    num_blocks: int  # usable blocks (the null block excluded)
    num_used_blocks: int  # held by live sequences: only preempting them gives these back
    num_free_blocks: int  # empty
    num_cached_blocks: int  # reusable KV nothing live holds: idle sessions' and the prefix cache's
    num_session_blocks: int  # of the cached, those idle sessions keep
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which found cached

    @property
    def num_available_blocks(self) -> int:
        """What a new sequence can have without preempting anything (cached KV is given up)."""
        return self.num_free_blocks + self.num_cached_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockPool:
    """The blocks, their reference counts, the LRU queue of unreferenced ones, the prefix-hash map,
    and how many blocks are in each BlockState (updated by every change, never recomputed)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_cnt = 1  # never freed, never handed out, in no state's count
        # Unreferenced blocks, least recently freed first: allocation takes from the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._by_hash: dict[bytes, KVBlock] = {}
        self._counts: Counter[BlockState] = Counter({BlockState.FREE: num_blocks - 1})

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_allocatable_blocks(self) -> int:
        """Unreferenced blocks, empty or holding a cached prefix: allocation can take them now."""
        return len(self._free)

    def count(self, state: BlockState) -> int:
        return self._counts[state]

    def _recount(self, block: KVBlock, before: BlockState) -> None:
        """Move a block just changed from its state `before` to its state now."""
        after = block.state
        if after is not before:
            self._counts[before] -= 1
            self._counts[after] += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """`num_blocks` fresh blocks with one reference each, or None if the pool is short."""
        if not self.can_allocate(num_blocks):
            return None
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            before = block.state
            if block.block_hash is not None:  # reusing a cached block evicts its prefix
                if self._by_hash.get(block.block_hash) is block:
                    del self._by_hash[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            self._recount(block, before)
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to blocks found in the prefix cache or shared by a fork."""
        for block in blocks:
            before = block.state
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            self._recount(block, before)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; unreferenced ones become free (hashed ones stay findable)."""
        for block in blocks:
            before = block.state
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:  # nothing worth keeping: reuse these first
                    self._free.move_to_end(block.block_id, last=False)
            self._recount(block, before)

    def keep(self, blocks: Iterable[KVBlock], kept: bool) -> None:
        """Mark (kept=True) or unmark one reference of each block as an idle session's kept turn."""
        for block in blocks:
            before = block.state
            block.kept_cnt += 1 if kept else -1
            self._recount(block, before)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._by_hash.get(block_hash)

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block findable by its hash (the first block with a given content wins)."""
        if block.block_hash is None and block_hash not in self._by_hash:
            before = block.state
            block.block_hash = block_hash
            self._by_hash[block_hash] = block
            self._recount(block, before)


class KVCacheManager:
    """Block tables of sequences on top of a BlockPool: allocate, share, copy-on-write, free."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, watermark: float = 0.01
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._copies: list[tuple[int, int]] = []
        self._registered: dict[int, int] = {}  # seq_id -> leading blocks already registered

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of every full block of the sequence's known tokens (none holding a
        placeholder of asynchronous scheduling), computed once each."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_known_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else b""
            tokens = array("q", seq.token_ids[i * bs : (i + 1) * bs]).tobytes()
            digest = hashlib.blake2b(digest_size=16)
            digest.update(parent)
            digest.update(len(seq.adapter_key).to_bytes(4, "little"))
            digest.update(seq.adapter_key)
            digest.update(tokens)
            seq.block_hashes.append(digest.digest())
        return seq.block_hashes

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of cached full blocks starting the sequence (always leaving one token to
        compute, whose logits the next sample needs)."""
        if not self.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(seq)[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count an admitted sequence's prefix-cache lookup (tokens asked for, tokens found)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_cached_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: Seq[KVBlock] = (), *, keep_watermark: bool = False
    ) -> bool:
        """Room for the sequence's next `num_new_tokens` tokens, after `cached` prefix blocks.

        Returns False, changing nothing, when the pool is short (keeping `watermark_blocks` free
        when asked, so that admitting a new sequence does not immediately force a preemption).
        """
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size
        num_new_blocks = max(
            0, self.blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(cached)
        )
        write_index = num_computed // self.block_size
        copy_on_write = (
            write_index < len(seq.block_table) and self.pool.blocks[seq.block_table[write_index]].ref_cnt > 1
        )
        revived = sum(1 for block in cached if block.ref_cnt == 0)  # leave the free queue when touched
        needed = num_new_blocks + revived + int(copy_on_write)
        reserve = self.watermark_blocks if keep_watermark else 0
        if self.pool.num_allocatable_blocks - needed < reserve:
            return False
        self.pool.touch(cached)
        seq.block_table.extend(block.block_id for block in cached)
        if copy_on_write:
            old = self.pool.blocks[seq.block_table[write_index]]
            (new,) = self.pool.allocate(1)
            seq.block_table[write_index] = new.block_id
            seq.table_edits += 1
            self.pool.free([old])
            self._copies.append((old.block_id, new.block_id))
        if num_new_blocks:
            seq.block_table.extend(block.block_id for block in self.pool.allocate(num_new_blocks))
        return True

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        start = self._registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq)
        for i in range(start, num_full):
            self.pool.register(self.pool.blocks[seq.block_table[i]], hashes[i])
        self._registered[seq.seq_id] = num_full

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past those `num_tokens` tokens need (the slots of rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(self.pool.blocks[i] for i in reversed(seq.block_table[keep:]))
            del seq.block_table[keep:]
            seq.table_edits += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks; the first write into a shared one copies it."""
        child.block_table = list(parent.block_table)
        self.pool.touch(self.pool.blocks[i] for i in child.block_table)
        self._registered[child.seq_id] = self._registered.get(parent.seq_id, 0)

    def transfer(self, src: Sequence, dst: Sequence, num_tokens: int) -> None:
        """Hand `src`'s KV for its first `num_tokens` tokens to `dst`, whose tokens start the same
        (a session's next turn continuing its last one); `src`'s blocks past them are freed."""
        keep = self.blocks_for(num_tokens)
        table, src.block_table = src.block_table, []
        src.table_edits += 1
        dst.table_edits += 1
        self.pool.free(self.pool.blocks[i] for i in reversed(table[keep:]))
        dst.block_table = table[:keep]
        num_full = num_tokens // self.block_size
        dst.block_hashes = src.block_hashes[:num_full]
        self._registered[dst.seq_id] = min(self._registered.pop(src.seq_id, 0), num_full)

    def keep(self, seq: Sequence) -> None:
        """The sequence is an idle session's kept turn now: its blocks count as cached, not used
        (unless a live sequence shares them), until `unkeep`."""
        self.pool.keep((self.pool.blocks[i] for i in seq.block_table), kept=True)

    def unkeep(self, seq: Sequence) -> None:
        """The kept turn is live again (its next turn adopts it) or about to be freed."""
        self.pool.keep((self.pool.blocks[i] for i in seq.block_table), kept=False)

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence (tail first, so shared prefixes stay cached longest)."""
        owned = set(seq.block_table)
        # A pending copy into a block this sequence is giving up would land in someone else's block.
        self._copies = [(src, dst) for src, dst in self._copies if dst not in owned]
        self.pool.free(self.pool.blocks[i] for i in reversed(seq.block_table))
        seq.block_table = []
        seq.table_edits += 1
        self._registered.pop(seq.seq_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies (source, destination) the runner must do before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        kept = pool.count(BlockState.KEPT)
        return KVCacheUsage(
            num_blocks=pool.num_usable_blocks,
            num_used_blocks=pool.count(BlockState.USED),
            num_free_blocks=pool.count(BlockState.FREE),
            num_cached_blocks=pool.count(BlockState.CACHED) + kept,
            num_session_blocks=kept,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
        )
