"""``RowBlock``, the one type of saved rows (gigashuffle/rowblock.py): how a rank's saved rows are dealt to its
writers on a resume (NOTE [ Checkpoint cut ] in checkpoint/cut.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gigashuffle.rowblock import RowBlock, share_bounds


def _ids(block: RowBlock) -> list[int]:
    return [int(v) for v in np.asarray(block.fields[0]).view(np.int64).ravel()] if len(block) else []


@pytest.mark.parametrize("count", [0, 1, 5, 8, 112])
@pytest.mark.parametrize("writers", [1, 2, 3, 4])
def test_dealt_shares_are_contiguous_and_even_and_hold_every_row_once(count: int, writers: int) -> None:
    block = RowBlock('{"fields": []}', (np.arange(count, dtype=np.int64).view(np.uint8).reshape(count, 8),))
    shares = block.dealt(writers)
    assert len(shares) == writers
    assert [i for s in shares for i in _ids(s)] == list(range(count)), "every row once, in order"
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert sizes == sorted(sizes, reverse=True), "the first shares take the extra rows (one saved row: writer 0)"
    assert [hi - lo for lo, hi in share_bounds(count, writers)] == sizes
