"""The drafter's own paged KV cache: a block pool and one slot (block table, progress) per sequence.

A slot stands in for its sequence where the block manager and the step builders read a sequence
(`block_table`, `num_computed_tokens`, `token_ids`, `seq_id`). Its tokens are the sequence's real
tokens followed by the drafts of the current round. Between rounds the slot keeps the KV of the
longest prefix it shares with the sequence (the real tokens and the drafts the target kept); the
positions after it (rejected drafts) are recomputed over, and their blocks past that are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from libs.engine import kv_cache
from libs.engine.block_manager import KVCacheManager
from libs.engine.models.config import ModelConfig
from libs.engine.sequence import Sequence


@dataclass
class DraftSlot:
    seq_id: int
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_real_tokens: int = 0  # the sequence's tokens when this round began (drafts follow them)
    adapter_key: bytes = b""  # the block manager hashes with it (prefix caching is off here)
    table_edits: int = 0  # the block manager counts edits of block_table (Sequence.table_edits)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids)  # a drafter's tokens are all on the host (no placeholders)


class DraftCache:
    """Blocks for the drafter's keys and values, one slot per drafting sequence."""

    def __init__(
        self, num_blocks: int, block_size: int, config: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0.0)
        self.block_size = block_size
        tensor = kv_cache.allocate(num_blocks, config, block_size, dtype, device)
        self.layers = [(tensor[n, 0], tensor[n, 1]) for n in range(tensor.shape[0])]
        self.slots: dict[int, DraftSlot] = {}

    def begin(self, seq: Sequence, limit: int) -> DraftSlot | None:
        """The sequence's slot for a round of `limit` drafts, with blocks for the tokens it has not
        computed yet and the limit - 1 drafts it will compute; None when the pool is short."""
        slot = self.slots.get(seq.seq_id)
        if slot is None:
            slot = self.slots[seq.seq_id] = DraftSlot(seq.seq_id)
        tokens = seq.token_ids
        # Keep what still matches the sequence, and always recompute its last token (its logits
        # give the first draft).
        valid = min(slot.num_computed_tokens, slot.num_real_tokens, len(tokens) - 1)
        end = min(slot.num_computed_tokens, len(tokens) - 1)
        while valid < end and slot.token_ids[valid] == tokens[valid]:
            valid += 1
        slot.num_computed_tokens = valid
        self.kv.trim(slot, valid)
        slot.token_ids = list(tokens)
        slot.num_real_tokens = len(tokens)
        if not self.kv.allocate_slots(slot, len(tokens) - valid + limit - 1):
            return None
        return slot

    def release(self, seq: Sequence) -> None:
        """Free the sequence's blocks (it finished or was preempted)."""
        slot = self.slots.pop(seq.seq_id, None)
        if slot is not None:
            self.kv.free(slot)

    @property
    def num_used_blocks(self) -> int:
        return self.kv.usage().num_used_blocks
