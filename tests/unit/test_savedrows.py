"""checkpoint/savedrows.py: the arrays made ready before a checkpoint's pause are shrunk in place to the rows saved
(no copy, and no surplus kept alive by the checkpoint), and more rows than estimated get new arrays."""

from __future__ import annotations

import numpy as np

from gigashuffle.checkpoint.savedrows import SavedRows


def _prepared(rows: int, widths: list[int]) -> SavedRows:
    saved = SavedRows.__new__(SavedRows)  # as the constructor leaves it, without a loader
    saved._arrays = [np.empty((rows, w), dtype=np.uint8) for w in widths]
    return saved


def test_fewer_rows_than_estimated_shrink_the_arrays_in_place() -> None:
    saved = _prepared(1 << 16, [64, 8])
    addresses = [a.ctypes.data for a in saved._arrays]
    out = saved._sized(40_000, [64, 8])
    assert [a.shape for a in out] == [(40_000, 64), (40_000, 8)]
    assert all(a.base is None and a.flags.owndata for a in out), "a view keeps the estimate's surplus alive"
    assert [a.ctypes.data for a in out] == addresses, "the rows were copied instead of the array shrunk"
    assert saved._arrays == []


def test_more_rows_than_estimated_get_new_arrays() -> None:
    saved = _prepared(1000, [16])
    out = saved._sized(1500, [16])
    assert out[0].shape == (1500, 16) and out[0].flags.owndata
