"""The rows a checkpoint's cut saves (NOTE [ Checkpoint cut ] in checkpoint/cut.py), in arrays made ready before the
pause, so that the copy takes no page fault.

Before the pause (``SavedRows(...)``): the buffer is mapped and, on a loader's first checkpoint, faulted in
(``TableView.rows_for_cut``), and one array per field is allocated and faulted in for the rows the cut will likely
save: the full slots now, plus a sixteenth of the buffer for the writers that write on until they pause, plus every
reader's whole ring. In the pause (``list_rows``), the arrays are shrunk in place to the rows saved (``ndarray.resize``
is ``realloc``, for an array this large ``mremap``: no byte is copied); the copy (``Listed.copy``) comes after the
readers went on, with the writers still held. If more rows come than estimated, new arrays are allocated in the
pause, as without this. (NOTE [ Faulting in before the pause ] in
shm/prefault.py has the figures.) The price is memory: the estimate's surplus over the rows saved (at most a
sixteenth of the buffer plus the rings' empty slots), held only during ``state_dict()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from gigashuffle.checkpoint.positions import Coverage
from gigashuffle.control.cutbarrier import NodeBarrier
from gigashuffle.errors import CheckpointError
from gigashuffle.host import memory
from gigashuffle.procs import failpoints
from gigashuffle.procs.messages import DatasetState
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.rowblock import RowBlock
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import SlotBuffer
from gigashuffle.shm.prefault import fault_in_for_write
from gigashuffle.trainer.supervisor import Supervisor

Rows = npt.NDArray[np.uint8]


class SavedRows:
    """One cut's arrays for the rows it saves; built before the pause, ``list_rows`` in it."""

    def __init__(self, sup: Supervisor, *, copy_buffer: bool, ahead: bool = True) -> None:
        """``ahead=False``: nothing is made ready (a cut by positions saves few rows)."""
        self._arrays: list[Rows] = []
        self.buffer: SlotBuffer | None = None
        table = sup.table() if copy_buffer and ahead else None
        self.buffer = sup.node_table.rows_for_cut() if table is not None else None
        layout: Layout | None = self.buffer.layout if self.buffer is not None else None
        ring_rows = 0
        for child in sup.readers():
            if child.ring is not None:
                ring_rows += child.ring.depth * child.ring.bs
                layout = layout or child.ring.layout
        if layout is None or not ahead:
            return

        fulls: list[int] = []

        def estimate() -> int:
            """Full slots now, plus a sixteenth of the buffer, plus twice what they grew by since the last look
            (while a buffer fills, its writers add rows fast: a first checkpoint of 1M tiny rows saw 76k more
            rows in the 21 ms of its allocation), plus the rings."""
            if table is None:
                return ring_rows
            fulls.append(table.counts()[2].full)  # the header, without the lock
            grown = fulls[-1] - fulls[0]
            return min(table.slots, fulls[-1] + table.slots // 16 + 2 * max(0, grown)) + ring_rows

        for _ in range(2):  # once more if the buffer filled faster than the margin meanwhile
            rows = estimate()
            if rows <= (len(self._arrays[0]) if self._arrays else 0):
                break
            self._arrays = []  # freed first: the new arrays take its pages, already backed
            _refuse_beyond_memory(rows, layout, sup)
            self._arrays = [np.empty((rows, spec.row_bytes), dtype=np.uint8) for spec in layout.fields]
            for array in self._arrays:
                fault_in_for_write(array)

    @classmethod
    def before_the_pause(
        cls, sup: Supervisor, barrier: NodeBarrier | None, number: int, *, copy_buffer: bool, ahead: bool
    ) -> SavedRows:
        """``SavedRows(...)`` for checkpoint ``number``; if that fails (no memory for the copy), the node's other
        ranks at its barriers fail at once, not after ``WAIT_S`` (NOTE [ Node cut ] in control/cutbarrier.py)."""
        try:
            return cls(sup, copy_buffer=copy_buffer, ahead=ahead)
        except BaseException:
            if barrier is not None:
                barrier.give_up(number)
            raise

    def list_rows(
        self,
        sup: Supervisor,
        answers: list[DatasetState],
        coverage: Coverage,
        handed: Sequence[tuple[ChildProcess, int]] = (),
    ) -> Listed:
        """In the pause: which rows the cut saves (those ``coverage`` does not cover of: the buffer's full slots,
        where this rank lists them; every batch announced and not handed out, and ``handed``, batches handed out
        and passed back as unconsumed; the rows of the last checkpoint that a writer had not yet put back), and the
        arrays sized for them. The copy may run once the readers go on (``Listed.copy``)."""
        table = sup.table() if coverage.lists_buffer else None
        marked = failpoints.ACTIVE and table is not None and coverage.copy_buffer
        if marked:
            failpoints.reached("cut.before_buffer_list")
        pieces: list[list[Any]] = []  # per source, per field: rows to copy as they are
        layout_json = ""
        for answer in answers:
            if len(answer.rows):
                pieces.append([np.asarray(f) for f in answer.rows.fields])
                layout_json = answer.rows.layout_json
        for child, k in [*sup.inbox.waiting(), *handed]:
            if child.ring is None:
                raise AssertionError("a batch announced by a reader without a ring")
            wanted = coverage.ring_rows(child.ring.origins(k))
            if wanted is None:
                pieces.append([f.numpy() for f in child.ring.regions(k)[0]])
            elif wanted.any():
                pieces.append([f.numpy()[wanted] for f in child.ring.regions(k)[0]])
            layout_json = layout_json or child.ring.layout.to_json()
        buffer, ids = None, np.empty(0, dtype=np.int64)
        if table is not None:
            buffer = self.buffer or sup.node_table.rows()
            layout_json = buffer.layout.to_json()
            ids = coverage.buffer_ids(table)
        total = len(ids) + sum(len(fields[0]) for fields in pieces)
        if not total:
            self._arrays = []
            return Listed(layout_json, [], None, ids, [], marked)
        widths = (
            [spec.row_bytes for spec in buffer.layout.fields] if buffer is not None else [a.shape[1] for a in pieces[0]]
        )
        return Listed(layout_json, self._sized(total, widths), buffer, ids, pieces, marked)

    def _sized(self, total: int, widths: list[int]) -> list[Rows]:
        """The prepared arrays resized to ``total`` rows in place (no copy), or new ones if there are none."""
        prepared, self._arrays = self._arrays, []
        if [a.shape[1] for a in prepared] != widths or total > len(prepared[0]):
            # More rows than estimated: new arrays, faulted in here. (A growth in place would zero the new rows
            # and, when the mapping cannot grow where it is, move the whole array: slower than fresh pages.)
            del prepared
            return [np.empty((total, width), dtype=np.uint8) for width in widths]
        for array, width in zip(prepared, widths, strict=True):
            array.resize((total, width), refcheck=False)  # a shrink: nothing else refers to it, no byte is copied
        return prepared


def _refuse_beyond_memory(rows: int, layout: Layout, sup: Supervisor) -> None:
    """A copy of ``rows`` rows larger than the memory available would get this trainer OOM-killed in the cut: fail
    the checkpoint before the pause instead (NOTE [ A buffer the node cannot hold ] in host/memory.py)."""
    need, found = rows * layout.row_bytes, memory.available()
    if found is None or need <= found[0]:
        return
    cfg = sup.config
    raise CheckpointError(
        f"state_dict() on queue {cfg.queue_name!r} rank {cfg.global_rank}: checkpoint_rows='saved' copies the "
        f"buffer's full rows into this process, about {rows} rows of {layout.row_bytes} B ({memory.gib(need)}), "
        f"and {found[1]} leaves {memory.gib(found[0])}; nothing was saved and the loader goes on. Use "
        "checkpoint_rows='positions' (it saves where rows came from, not the rows), or a smaller shuffle_size"
    )


@dataclass(frozen=True)
class Listed:
    """The rows a cut saves, listed in its pause: the arrays sized for them (empty: no row to save), the buffer's
    full slots, the other sources' rows."""

    layout_json: str
    views: list[Rows]
    buffer: SlotBuffer | None
    ids: Any  # the buffer's full slots at the cut
    pieces: list[list[Any]]  # per source (a writer's rows not put back, a ring batch), per field: rows as they are
    marked: bool = False  # the copy of the buffer's rows reaches the fail point "cut.before_buffer_copy"

    def copy(self) -> RowBlock:
        """Copy the listed rows into their arrays: each row once, straight into its place. The buffer's rows may be
        copied after the readers went on (they leave a slot's bytes as they are) but not once a writer may write
        again: the cut holds the node's writers until every rank copied (NOTE [ Checkpoint cut ])."""
        if not self.views:
            return RowBlock()
        if self.marked and self.buffer is not None:
            failpoints.reached("cut.before_buffer_copy")
        copy_rows(self.views, self.buffer, self.ids, self.pieces)
        return RowBlock(self.layout_json, tuple(torch.from_numpy(v) for v in self.views))


def copy_rows(views: list[Rows], buffer: SlotBuffer | None, ids: Any, pieces: list[list[Any]]) -> None:
    """Fill ``views`` (one ``uint8 [n, row_bytes]`` array per field) with the buffer's rows ``ids``, then each piece's
    rows in order: each row copied once, straight into its place (most of a cut's work: it runs after the pause)."""
    if buffer is not None and len(ids):
        buffer.gather(ids, [v[: len(ids)] for v in views], ids_in_range=True)
    at = len(ids)
    for fields in pieces:
        n = len(fields[0])
        for view, rows in zip(views, fields, strict=True):
            view[at : at + n] = rows
        at += n
