"""The node barrier of a checkpoint's cut: every local rank of a node waits until all of them reached a phase.

NOTE [ Node cut ]
The ranks of a node share one buffer, so a checkpoint copies it once, and only while nothing moves in it: every
writer and reader of every local rank paused. Every rank calls ``state_dict()`` at the same step (as it would
save a model); its cut number is how many times this loader did (a resumed job counts from 1 again). The cut
(NOTE [ Checkpoint cut ] in checkpoint/cut.py) passes three barriers:
  1. ``PAUSED``: this rank's writers and readers are paused. Past it, local rank 0 lists the buffer's full slots,
     every rank its own announced batches;
  2. ``LISTED``: this rank listed the rows it saves. Past it, the rank resumes its readers (no reader of the node
     may draw a slot before rank 0 listed it) and copies the rows it listed;
  3. ``COPIED``: this rank copied what it saves. Past it, the rank resumes its writers (none may write a slot
     before rank 0 copied it).
Each rank records in one hash, ``cut:<generation>`` (control/keys.py), field ``<local rank>`` = ``<cut> <phase>
<token>``, and reads the others' in the same Lua call (``lua.CUT_ARRIVE``), polling until none is missing. The cut
number is taken first in ``state_dict()`` (``CutState.next_number`` in checkpoint/cutstate.py), so a call that
fails still counts on its rank. A rank's later cut counts as past the last phase of an earlier one (it left that
barrier and began its next checkpoint); at an earlier phase a live rank at a later cut means the ranks numbered
their checkpoints differently, and fails the cut at once (its later entries must not open this cut's barriers).
An entry counts only while its token holds that rank's claim now, so an entry of a dead trainer or of an earlier
job (one of the same generation whose claims lapsed and were taken over) never satisfies a barrier; the generation
in the key keeps earlier sessions out, and the TTL (refreshed at every arrival) drops the hash once cuts stop. A rank
that does not arrive within ``WAIT_S`` fails the checkpoint of every other rank with a ``CheckpointError`` that
names it and where it was; no rank resumes its writers before every rank copied, so a failed cut saves nothing
inconsistent (a rank that arrives late finds the others' later phase missing and fails too). A rank whose cut fails
before it arrived at ``COPIED`` (a Ctrl-C, a writer that never answered, a barrier's own timeout) records phase 0,
``GAVE_UP``, for that cut: the node's other ranks at that cut fail at their next poll with a ``CheckpointError``
that names it, instead of waiting ``WAIT_S`` for a rank that is not coming (they would fail then anyway: this only
makes it sooner). It never fails a cut that could have completed: a rank that gave up never arrives at that cut's
``COPIED``. A poll is one Redis call (~0.1 ms); it starts at 0.5 ms and backs off to 20 ms, so a node's ranks leave
a barrier within a millisecond of the last arrival while they arrive together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gigashuffle.control import lua
from gigashuffle.control.client import address, run_script
from gigashuffle.control.plane import ControlPlane, text
from gigashuffle.errors import CheckpointError, GigashuffleError

log = logging.getLogger(__name__)

GAVE_UP, PAUSED, LISTED, COPIED = 0, 1, 2, 3
_PHASES = {PAUSED: "paused its writers and readers", LISTED: "listed the rows it saves", COPIED: "copied its rows"}
WAIT_S = 60.0  # how long a rank waits for the node's other ranks at one barrier
TTL_MS = 600_000  # the cut hash outlives a node's checkpoints by ten minutes
_FIRST_POLL_S, _LAST_POLL_S = 0.0005, 0.02
_AHEAD_STATUS, _GAVE_UP_STATUS = 1, 2  # lua.CUT_ARRIVE's status of a rank that has not arrived


@dataclass
class NodeBarrier:
    """One trainer's side of its node's cut barriers (NOTE [ Node cut ])."""

    store: ControlPlane
    queue: str
    global_rank: int
    local_rank: int
    local_world_size: int
    token: str  # this trainer's claim token (control/session.py)

    def __post_init__(self) -> None:
        self._script = self.store.client.register_script(lua.CUT_ARRIVE)
        self._where = address(self.store.client)

    def arrive(self, cut: int, phase: int) -> dict[int, str]:
        """Record that this rank reached ``(cut, phase)``; the local ranks that have not, with their entries. A live
        rank at a later checkpoint before the last phase raises ``CheckpointError``: the ranks numbered their
        checkpoints differently, and waiting would let its later entries pass this cut's barriers."""
        keys = self.store.keys
        first = self.global_rank - self.local_rank
        claims = [keys.rank(first + i) for i in range(self.local_world_size)]
        args = [self.local_rank, self.token, cut, phase, TTL_MS, COPIED]
        reply = run_script(self._script, [keys.cut(self.store.generation), *claims], args, self._where)
        missing = {int(reply[i]): text(reply[i + 1]) for i in range(0, len(reply), 3)}
        status = {int(reply[i]): int(reply[i + 2]) for i in range(0, len(reply), 3)}
        gave_up = [first + r for r, s in status.items() if s == _GAVE_UP_STATUS]
        if gave_up and phase != GAVE_UP:
            raise CheckpointError(
                f"queue {self.queue!r} rank {self.global_rank}: checkpoint {cut} cannot complete: global ranks "
                f"{gave_up} of this node gave it up (their state_dict() raised before the cut was done; see their "
                "log); nothing was saved. Call state_dict() again on every rank"
            )
        ahead = [r for r, s in status.items() if s == _AHEAD_STATUS]
        if ahead and phase != GAVE_UP:
            where = ", ".join(f"global rank {first + r} at checkpoint {missing[r].split(' ', 1)[0]}" for r in ahead)
            raise CheckpointError(
                f"queue {self.queue!r} rank {self.global_rank}: this is checkpoint {cut} of this loader, but {where}: "
                "the node's ranks called state_dict() a different number of times (every rank, writer-only ones "
                "too, must call it at the same steps); nothing was saved"
            )
        return missing

    def give_up(self, cut: int) -> None:
        """Record that this rank's ``cut`` failed before it copied: the others waiting in it fail at once. Never
        raises (it runs on the way out of a failed cut): without Redis the others fail after ``WAIT_S``."""
        try:
            self.arrive(cut, GAVE_UP)
        except GigashuffleError as exc:
            log.warning("queue %r rank %d: could not tell the node's other ranks that checkpoint %d failed here (%s);"
                        " theirs fails after %.0f s", self.queue, self.global_rank, cut, exc, WAIT_S)  # fmt: skip

    def wait(
        self, cut: int, phase: int, deadline: float, pump: Callable[[float], None], now: Callable[[], float]
    ) -> None:
        """Arrive at ``(cut, phase)`` and wait until every local rank did; ``pump(s)`` waits up to ``s`` seconds
        while serving this rank's children. Past ``deadline`` raise ``CheckpointError`` naming the missing ranks."""
        poll = _FIRST_POLL_S
        while True:
            missing = self.arrive(cut, phase)
            if not missing:
                return
            if now() > deadline:
                raise CheckpointError(self._missing_message(cut, phase, missing))
            pump(poll)
            poll = min(poll * 2, _LAST_POLL_S)

    def _missing_message(self, cut: int, phase: int, missing: dict[int, str]) -> str:
        first = self.global_rank - self.local_rank
        where = []
        for local, entry in sorted(missing.items()):
            parts = entry.split(" ", 2)
            seen = f"last at cut {parts[0]} phase {parts[1]}" if len(parts) == 3 else "never took part in a cut"
            where.append(f"global rank {first + local} (local rank {local}: {seen})")
        return (
            f"queue {self.queue!r} rank {self.global_rank}: checkpoint {cut} waited in vain for the node's "
            f"ranks to have {_PHASES[phase]}: {', '.join(where)}. Every rank of a node (writer-only ranks "
            "too) must call state_dict() at the same step; a rank that died or calls it less "
            "often leaves its node's cut unfinished"
        )
