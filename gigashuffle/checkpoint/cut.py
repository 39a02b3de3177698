"""A checkpoint's consistent cut: the datasets' states plus every row that was read from them and not delivered.

NOTE [ Checkpoint cut ]
``state_dict()`` must bring back, exactly once, every row no trainer of the node has been handed yet: rows full
in the buffer, in a reader's ring, waiting in a trainer, in a writer's chunk not yet copied. It saves the rows
themselves ("rows way"), so any stateful dataset works. Every rank of the node calls it at the same step, and each:
  1. sends every writer ``StateRequest(pause=True)``: the writer publishes every row it copied, answers its
     dataset's state for exactly the rows not in the buffer (between chunks, ``state_dict()``; inside a chunk, the
     state before that chunk and ``skip`` = the rows of it already copied: NOTE [ Respawned writers ] in
     procs/resume.py), and writes nothing until ``Resume``. A writer still putting a checkpoint's rows back
     answers with the rows it has not put back yet, which this cut saves again. A writer that dies is asked again
     once started again (it starts held);
  2. sends every reader ``Pause`` in the same round as 1 (the two waits overlap: on a busy node each is a wait
     for the scheduler): it gathers what it had drawn, announces those batches, answers ``Paused`` and draws
     nothing until ``Resume``. The channel keeps order, so the trainer has every announced batch once it has the
     ``Paused``;
  3. waits at the node barrier ``PAUSED`` until every local rank did 1 and 2 (NOTE [ Node cut ] in
     control/cutbarrier.py; no barrier with one rank per node): from then on nothing moves in the node's buffer;
  4. lists the rows it saves: every announced batch not yet handed to its caller and, on local rank 0 only, every
     full slot of the buffer, less the rows a writer of the node writes again on a resume (``positions.Coverage``:
     none in this way; by positions, NOTE [ Positions checkpoint ]); waits at the barrier ``LISTED`` until every
     local rank listed;
  5. resumes its readers: the node delivers again (the pause ends here). A reader leaves the bytes of a slot it
     draws as they are, and no writer writes, so the listed rows stay what they were at the cut;
  6. copies the listed rows, one ``uint8 [n, row_bytes]`` tensor per field, into arrays allocated and faulted in
     before step 1, with the buffer itself (mapped with the slot table on that rank) faulted in before a loader's
     first pause (checkpoint/savedrows.py, NOTE [ Faulting in before the pause ]). A ring batch listed is not handed
     out before the copy (this thread does both), so its reader does not reuse its ring slot;
  7. waits at the barrier ``COPIED`` until every local rank copied, then resumes its writers. Training goes on
     from the same buffer: the cut changes nothing it delivers.
Every answer names what it answers (``DatasetState.request``, ``Paused(cut)``, each barrier entry its cut): an
answer to an earlier, aborted cut never counts for this one. A Ctrl-C is raised only where the cut waits: the cut is one
blocking section (NOTE [ Ctrl-C ] in procs/interrupts.py), so its cleanup (every child resumed, the cut's state
ended) runs whole whatever lands when, and the next ``state_dict()`` starts clean.
On ``load_state_dict`` each rank's writers put that rank's saved rows back into the new buffer, a contiguous share
each (``RowBlock.dealt``; published, not counted as their dataset's rows), before they read their datasets on from
their saved states and skips. One writer putting them all back raced the others' fresh rows for empty slots alone:
under load that writer could be off the CPU for seconds while the node went on delivering fresh rows, and a big
checkpoint came back one writer's copy at a time. So every row not handed to a trainer before ``state_dict()`` comes
back once, in a new random order, and none handed before it comes back. Batches handed out before the call count as
consumed, whether or not the step that took them finished, unless the caller passes them as
``state_dict(unconsumed=[...])`` (a prefetching loop): their rows are read back from the batches and saved after the
cut's (checkpoint/unconsumed.py). Not for ``fill_once`` or ``evict_on_read=False``, where a row may be delivered
more than once: there each rank saves its writers' states (unpaused) and no row, and says so once per queue in a
warning.
Figures (pause, size, resume) per workload in docs/benchmarks.md, from ``python -m gigashuffle.tools.bench.checkpoint``.
The copy was most of the pause (at ``shuffle_size`` 1M tiny rows, 80 B: 14 ms of ~20 on a quiet 2-core VM, 39 ms
of 41-60 with four CPU-bound processes beside the loader); from step 5 on it runs while the node delivers, and
only the writers wait for it, with a full buffer in front of the readers. With several ranks per node the three
barriers add three Redis calls (~0.2 ms each) and the wait for the node's slowest rank.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from gigashuffle.checkpoint import positions
from gigashuffle.checkpoint.cutstate import CutState
from gigashuffle.checkpoint.savedrows import SavedRows
from gigashuffle.config import DataloaderConfig
from gigashuffle.control import cutbarrier
from gigashuffle.control.cutbarrier import NodeBarrier
from gigashuffle.errors import CheckpointError
from gigashuffle.procs import failpoints, interrupts
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import DatasetState, Go, Pause, Resume, StateRequest
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.rowblock import RowBlock
from gigashuffle.trainer.supervisor import Supervisor

log = logging.getLogger(__name__)
_requests = itertools.count(1)
_POLL_S = 0.02
# How long a cut tries to map an unmapped slot table (each try waits up to 2 s for an attach socket).
_TABLE_FOR_CUT_S = 5.0


def take(
    sup: Supervisor,
    cuts: CutState,
    config: DataloaderConfig,
    number: int,
    timeout_s: float,
    handed: Sequence[tuple[ChildProcess, int]] = (),
) -> tuple[list[DatasetState], RowBlock]:
    """Checkpoint ``number``'s cut (``CutState.next_number``; ``handed``: unconsumed batches found in their ring
    slots, by positions), in one blocking section (NOTE [ Ctrl-C ] in procs/interrupts.py): a Ctrl-C is raised only
    where the cut waits (``_pump``), so its cleanup (every child resumed, the cut's state ended) runs whole."""
    with critical(blocking=True):
        return _take(sup, cuts, config, number, timeout_s, handed)


def _take(
    sup: Supervisor,
    cuts: CutState,
    config: DataloaderConfig,
    number: int,
    timeout_s: float,
    handed: Sequence[tuple[ChildProcess, int]],
) -> tuple[list[DatasetState], RowBlock]:
    deadline = time.monotonic() + timeout_s
    pause = config.delivers_once  # the other modes save only the datasets' positions, unpaused
    if not pause:
        _warn_inexact(config)
    copy_buffer = config.local_rank == 0
    by_positions = pause and config.checkpoint_rows == "positions"
    barrier = _barrier(sup, config) if pause else None
    # Before the pause: the buffer mapped, the rows' arrays made and faulted in (savedrows.py; by positions: none).
    prepare = SavedRows.before_the_pause
    saved = prepare(sup, barrier, number, copy_buffer=copy_buffer, ahead=not by_positions) if pause else None
    started = time.monotonic()  # the pause starts here
    cuts.begin(pause)
    readers = _ReaderPause(sup, cuts, config, number)
    marks: list[tuple[str, float]] = []
    copied = False  # past its copy this rank may be at COPIED for the node's others: it never gives the cut up then
    try:
        # Readers are asked with the writers, not after them: the two waits overlap (a writer putting saved rows
        # back still answers when paused readers leave it no empty slot: it sends the rows left with its state).
        answers = _writer_states(sup, cuts, config, deadline, pause, readers if pause else None)
        marks.append(("writers", time.monotonic()))
        if saved is None:
            return answers, RowBlock()
        readers.wait(deadline)
        marks.append(("readers", time.monotonic()))
        _wait(sup, barrier, number, cutbarrier.PAUSED, deadline)
        coverage = positions.Coverage(config, answers, by_positions, copy_buffer)
        if coverage.lists_buffer:  # fail closed without the table
            _table_for_cut(sup, config, deadline)
        marks.append(("barrier", time.monotonic()))
        listed = saved.list_rows(sup, answers, coverage, handed)
        _wait(sup, barrier, number, cutbarrier.LISTED, deadline)
        marks.append(("list", time.monotonic()))
        readers.resume()  # the node delivers again; its writers stay held until every rank copied
        rows = listed.copy()
        marks.append(("copy", time.monotonic()))
        copied = True
        _wait(sup, barrier, number, cutbarrier.COPIED, deadline)
        return coverage.rebased(answers), rows
    finally:
        if pause:
            readers.resume()
            for child in sup.writers():
                sup.send(child, Resume())  # a dying one's successor starts unpaused
            if sup.go:
                sup.send_to_writers(Go())  # writers started during the cut started held
        cuts.end(started, readers.resumed_at, _parts(started, marks))
        if barrier is not None and not copied:
            barrier.give_up(number)  # the node's others fail now, not after WAIT_S (NOTE [ Node cut ])


def _table_for_cut(sup: Supervisor, config: DataloaderConfig, deadline: float) -> None:
    """Map the node's slot table, which the cut lists the buffer's rows from. Going on without it is right only
    while no buffer exists (none published, none attached to by a child of this rank): then it holds no row. A
    buffer whose table cannot be mapped by ``deadline`` fails the checkpoint, instead of a cut that silently saves
    none of the buffer's rows."""
    deadline = min(deadline, time.monotonic() + _TABLE_FOR_CUT_S)
    while sup.table() is None:
        if "hmac" not in sup.session.store.meta() and not any(c.attached for c in sup.children):
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"queue {config.queue_name!r} rank {config.global_rank}: the checkpoint cannot map the node's slot "
                f"table (no process of the node answered on its attach socket in {_TABLE_FOR_CUT_S:.0f} s), so it "
                "cannot save the buffer's rows; nothing was saved. See the log for the attach errors, and call "
                "state_dict() again"
            )
        _pump(sup, _POLL_S)


def _pump(sup: Supervisor, seconds: float) -> None:
    """Serve the children for up to ``seconds``: the cut's one place to wait, and where a Ctrl-C is raised."""
    sup.pump(seconds)
    interrupts.interrupt_point()


def _barrier(sup: Supervisor, config: DataloaderConfig) -> NodeBarrier | None:
    """The node barrier, or None for a node of one rank (nothing to wait for)."""
    if config.local_world_size == 1:
        return None
    return NodeBarrier(sup.session.store, config.queue_name, config.global_rank, config.local_rank,
                       config.local_world_size, sup.session.token)  # fmt: skip


def _wait(sup: Supervisor, barrier: NodeBarrier | None, number: int, phase: int, deadline: float) -> None:
    if barrier is not None:
        deadline = min(deadline, time.monotonic() + cutbarrier.WAIT_S)
        barrier.wait(number, phase, deadline, lambda seconds: _pump(sup, seconds), time.monotonic)


_warned: set[str] = set()


def _warn_inexact(config: DataloaderConfig) -> None:
    """Say once per queue what a checkpoint of a mode that reads a row more than once does not bring back."""
    if config.queue_name in _warned:
        return
    _warned.add(config.queue_name)
    mode = "fill_once=True" if config.fill_once else "evict_on_read=False"
    log.warning(
        "queue %r: with %s a checkpoint saves only the datasets' positions, not the rows in the buffer or the "
        "rings (a row may be delivered more than once in this mode, so 'consumed' is not defined): a resume "
        "refills the buffer from those positions, and up to shuffle_size rows read from the datasets before the "
        "checkpoint are not seen again",
        config.queue_name,
        mode,
    )


def _writer_states(
    sup: Supervisor,
    cuts: CutState,
    config: DataloaderConfig,
    deadline: float,
    pause: bool,
    readers: _ReaderPause | None,
) -> list[DatasetState]:
    """Every writer's answer; a writer that dies before it answers is asked again once started again. ``readers``
    are asked to pause in the same rounds."""
    answers: dict[int, DatasetState] = {}
    asked: dict[int, tuple[int, int]] = {}  # writer index -> (the child's spawn seq, the request it got)
    while len(answers) < config.num_writers:
        for child in sup.writers():
            if child.index in answers or asked.get(child.index, (-1, 0))[0] == child.seq:
                continue
            request = next(_requests)
            if not sup.send(child, StateRequest(request, pause)):
                continue  # it is dying: the zygote reports its exit and the supervisor starts it again
            asked[child.index] = (child.seq, request)
        if readers is not None:
            readers.ask()
        _pump(sup, _POLL_S)
        for index, (_seq, request) in asked.items():
            answer = cuts.answer_of(index)
            if answer is not None and answer.request == request:
                answers[index] = answer
        if time.monotonic() > deadline and len(answers) < config.num_writers:
            missing = sorted(set(range(config.num_writers)) - set(answers))
            raise CheckpointError(
                f"queue {config.queue_name!r} rank {config.global_rank}: writers {missing} did not report their "
                "dataset state in time (a dataset whose __iter__ blocks between chunks cannot answer; see the log "
                "for a writer that keeps dying)"
            )
    return [answers[i] for i in range(config.num_writers)]


class _ReaderPause:
    """Asks every reader of the rank to pause (once per spawned child), tells when all that hold rows have, and
    resumes them."""

    def __init__(self, sup: Supervisor, cuts: CutState, config: DataloaderConfig, number: int) -> None:
        self._sup, self._cuts, self._config, self._number = sup, cuts, config, number
        self._asked: dict[int, int] = {}  # spawn seq -> Supervisor.pumps when its Pause went out
        self._resumed: set[int] = set()
        self.resumed_at: float | None = None  # when the first Resume went out: the node's delivery pause ends

    def ask(self) -> None:
        for child in self._sup.readers():
            if child.seq not in self._asked and self._sup.send(child, Pause(self._number)):
                self._asked[child.seq] = self._sup.pumps
        if failpoints.ACTIVE:
            failpoints.reached("cut.readers_asked")

    def wait(self, deadline: float) -> None:
        while True:
            self.ask()
            # A reader asked before a pump and still without a ring sent its ring after its Pause was written, so
            # it reads the Pause before its first draw and holds no rows. One asked since the last pump may have
            # sent its ring and drawn before its Pause came: it counts once a pump has read what it sent.
            pumps = self._sup.pumps
            if all(
                self._cuts.is_paused(c) if c.ring is not None else self._asked.get(c.seq, pumps) < pumps
                for c in self._sup.readers()
            ):
                return
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"queue {self._config.queue_name!r} rank {self._config.global_rank}: readers did not pause for "
                    "the checkpoint in time"
                )
            _pump(self._sup, _POLL_S)

    def resume(self) -> None:
        """Resume every reader not resumed yet, and those started since (a reader started in a cut starts paused)."""
        if self.resumed_at is None:
            self.resumed_at = time.monotonic()
        for child in self._sup.readers():
            if child.seq not in self._resumed and self._sup.send(child, Resume()):
                self._resumed.add(child.seq)  # a dying one's successor starts unpaused


def _parts(started: float, marks: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds each phase of the cut took (for the bench): the writers' answers, the readers' pause, the node
    barrier, the listing (the pause ends there), the copy."""
    parts, before = {}, started
    for name, at in marks:
        parts[name], before = at - before, at
    return parts
