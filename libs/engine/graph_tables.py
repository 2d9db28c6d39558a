"""The block tables of a captured decode step, kept in its device region between replays.

A decode graph reads block tables `max_blocks_per_seq` wide (its shapes are fixed), one row per
padded sequence. Written whole every step they cost a host fill and a copy of rows x width entries
(about 2 MB a step at 32 k tokens of context and 256 rows), though from one step to the next a row
gains at most one block. So the region keeps its tables, and each replay sends only the entries a
row lacks: the new blocks of the sequence it held last time, or the whole table of a sequence it
did not hold (or whose table was edited in place: `Sequence.table_edits`). Entries past a row's
length are never read (attention stops at the sequence's length), so nothing is cleared; padding
rows keep whatever their row last held, valid block ids that their one token reads and writes
nothing to.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TableOwner(Protocol):
    """What a row's table is read from (a Sequence)."""

    seq_id: int
    table_edits: int
    block_table: list[int]


class ResidentTables:
    """What each row of one captured step's device block table holds."""

    def __init__(self, rows: int) -> None:
        # Per row: (seq_id, that sequence's table_edits, entries sent), or nothing for a row never used.
        self._held: list[tuple[int, int, int] | None] = [None] * rows

    def changes(self, seqs: list[TableOwner]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The entries to write for the sequences in rows 0..len(seqs)-1: rows, columns and block
        ids (int64 each), and the rows are recorded as holding them."""
        rows: list[int] = []
        cols: list[int] = []
        blocks: list[int] = []
        for row, seq in enumerate(seqs):
            table = seq.block_table
            held = self._held[row]
            start = 0
            if held is not None and held[:2] == (seq.seq_id, seq.table_edits) and held[2] <= len(table):
                start = held[2]
            if start < len(table):
                rows += [row] * (len(table) - start)
                cols += range(start, len(table))
                blocks += table[start:]
            self._held[row] = (seq.seq_id, seq.table_edits, len(table))
        return (
            np.array(rows, dtype=np.int64),
            np.array(cols, dtype=np.int64),
            np.array(blocks, dtype=np.int64),
        )
