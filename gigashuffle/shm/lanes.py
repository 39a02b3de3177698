"""Lanes: one journaled counter per writer stream and per reader of a node, in the slot table beside the slots.

NOTE [ Lanes ]
A process killed between a transition and its own bookkeeping of it breaks exactness in two places:
  * a writer that commits rows and is SIGKILLed before it counts them: its successor, which resumes after the
    last row counted (NOTE [ Respawned writers ] in procs/resume.py), writes those rows again;
  * a reader that releases the slots of the batches it gathered (they become empty: the rows are now only in its
    ring) and is SIGKILLed before it announces them: the rows are gone (NOTE [ Reader cycle ] in procs/reader.py).
So the count moves with the transition itself: the commit and the release journal the new value of the process's
lane together with the slots they move (NOTE [ Slot journal ] in shm/journal.py), and a roll-forward sets it again.
Whatever instruction a process dies at, its lane counts exactly the rows committed (or the batches released) by
it and its predecessors on that lane. With stripes (NOTE [ Stripes ] in shm/stripes.py) each stripe has its own
cell of every lane, moved by that stripe's ops, and a lane's value is the sum of its cells. The trainer reads the
lane under every stripe's lock after a death (each lock's roll-forward first completes an op the dead process was
inside) and:
  * for a writer: its committed rows are ``lane - base``, where ``base`` is the lane's value when the writer's
    stream started minus the rows skipped (the writer stores it in its own counter page, procs/resume.py);
  * for a reader: every batch gathered into its ring carries its sequence number ``lane + i + 1`` (written
    before the release); a ring slot the reader holds whose number is at most the lane was released and never
    announced, and the trainer delivers it from the ring as if announced (trainer/inbox.py). The trainer zeroes a
    ring slot's number when the slot is announced to it, so that only slots the reader holds carry one.
A lane's value only grows; a writer has two (its dataset's rows; a checkpoint's saved rows put back), a reader one.
"""

from __future__ import annotations

LANES = 16384  # int64 counters per node table (128 KiB)
_PER_RANK = 512  # lanes of one local rank: writers' pairs first, then readers
_WRITERS_MAX = 128  # writers per rank with lanes (two each)
NO_LANE = -1


def writer_lanes(local_rank: int, index: int) -> tuple[int, int]:
    """(stream lane, saved-rows lane) of writer ``index`` of ``local_rank``; NO_LANE for a node too large (then
    a death can repeat up to one commit's rows, as before lanes)."""
    if index >= _WRITERS_MAX or (local_rank + 1) * _PER_RANK > LANES:
        return NO_LANE, NO_LANE
    first = local_rank * _PER_RANK + 2 * index
    return first, first + 1


def reader_lane(local_rank: int, index: int) -> int:
    """The lane of reader ``index`` of ``local_rank``, or NO_LANE (a node too large: a reader killed between its
    release and its announcement then loses that draw's batches)."""
    if index >= _PER_RANK - 2 * _WRITERS_MAX or (local_rank + 1) * _PER_RANK > LANES:
        return NO_LANE
    return local_rank * _PER_RANK + 2 * _WRITERS_MAX + index
