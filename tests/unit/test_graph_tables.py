"""A decode graph's block tables stay on the device: each replay writes only the entries a row
lacks (graph_tables.py)."""

from __future__ import annotations

from libs.engine.graph_tables import ResidentTables
from libs.engine.sampling_params import SamplingParams
from libs.engine.sequence import Sequence


def _seq(blocks: list[int]) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(), request_seed=0)
    seq.block_table = list(blocks)
    return seq


def _written(changes) -> list[tuple[int, int, int]]:
    return list(zip(*(a.tolist() for a in changes), strict=True))


def test_a_row_first_gets_its_whole_table_then_only_the_blocks_it_gains():
    tables = ResidentTables(rows=4)
    a, b = _seq([7, 8]), _seq([3])
    assert _written(tables.changes([a, b])) == [(0, 0, 7), (0, 1, 8), (1, 0, 3)]
    assert _written(tables.changes([a, b])) == []  # nothing new: nothing sent
    a.block_table.append(9)
    assert _written(tables.changes([a, b])) == [(0, 2, 9)]


def test_a_row_that_holds_another_sequence_now_gets_its_whole_table():
    tables = ResidentTables(rows=2)
    a, b, c = _seq([1, 2]), _seq([5, 6, 7]), _seq([4])
    tables.changes([a, b])
    # `a` ended: `b` moves up a row and `c` takes the second
    assert _written(tables.changes([b, c])) == [(0, 0, 5), (0, 1, 6), (0, 2, 7), (1, 0, 4)]


def test_an_edit_in_place_sends_the_table_again():
    tables = ResidentTables(rows=1)
    seq = _seq([10, 11])
    tables.changes([seq])
    seq.block_table[1] = 12  # a copy-on-write of the last block, as the block manager counts it
    seq.table_edits += 1
    assert _written(tables.changes([seq])) == [(0, 0, 10), (0, 1, 12)]
    del seq.block_table[1:]  # a trim, then a new block in its place
    seq.block_table.append(13)
    seq.table_edits += 1
    assert _written(tables.changes([seq])) == [(0, 0, 10), (0, 1, 13)]
