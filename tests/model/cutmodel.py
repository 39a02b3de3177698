"""An in-process, deterministic explorer of the checkpoint cut's interleavings (issue 32, item 6).

What it is. The actors of one node: writers (procs/writer.py), readers (procs/reader.py) and one or two trainers
(trainer/supervisor.py + trainer/cut.py, with the node barrier of control/cutbarrier.py for two), each written as
a step function: an actor's state carries a program counter, and ``_step`` runs it to the end of its next atomic
step (the real code's steps are separated by a transition of the slot table, a message sent or received, or a
wait; a step's purely local work is folded into it). Generators would read more like the real loops, but a
generator cannot be copied, so a depth-first search over them could not fork a state or remember one it saw. The
world (every actor, every channel, the slot table of tests/model/table.py) is one immutable value; ``explore``
runs a depth-first search over every order of the enabled steps, remembering the worlds it has seen, plus at
every step a SIGKILL of each live child (``kills`` of them per run) and a KeyboardInterrupt at each step of a
trainer's cut (``interrupts`` per run; the cut is abandoned through its ``finally`` and a checkpoint is taken
again later). A run ends when every trainer has taken its checkpoint; then the checkpoint is resumed: every
row handed to a trainer before its ``state_dict()`` plus every row the resume brings back (the saved rows, and
each writer's stream from its saved state after its skip) must be the pass's rows, each exactly once.

Both ways of a checkpoint (``Config.positions``). Saved rows: NOTE [ Checkpoint cut ] (checkpoint/cut.py). By
positions, NOTE [ Positions checkpoint ] (checkpoint/positions.py, procs/positions.py): each writer keeps a
``Track`` (its base, the states before its recent chunks within ``keep_rows`` of its own rows, its filter, the
current chunk's stream rows) as fields of ``Writer``, stamps each row's origin (lane, stream row) into the table's
``origin`` column, and answers a ``StateRequest`` with ``Track.answer`` (at, head, kept states, keep, until). The
cut (``_cut_rows``: SavedRows.list_rows with positions.Coverage and _covered) collects per lane the stream rows at
or after the oldest kept state from the full slots and the announced batches' origins, and saves every other row of
its lanes (of any lane in its own rings; on local rank 0 rows of no lane) as a row; ``_entry_of`` is
positions.entry_of; the resume (``check``) refuses an entry ``positions.checked`` would refuse, and else writes the
rows of ``keep`` and every row from ``until`` on, from ``state`` taken as stream row ``at``. A run can itself start
from a positions checkpoint (``resumed_filter``), so a writer's filter, its ``Track.select`` and a respawn's
``filtered_commits`` are explored too. Both ways take the same steps and barriers (PAUSED, LISTED, the readers
resumed, the copy, COPIED); by positions the rows of a ring batch are taken when listed.

What is real and what is a model. The real loops block on sockets, threads and ``flock``, and cannot be stopped
between two steps, so they are transcribed: the comment at each rule names the code it follows (line numbers as
of commit deee634; the positions way as of 392b28e, by function name). Real code driven here: the pure functions
``folded`` and ``filtered_commits`` and the origin's encoding (``LANE_SHIFT``, ``ROW_MASK``, ``NO_ORIGIN``) of
procs/positions.py. Checked against the real code op by op: the slot table of tests/model/table.py against
``SlotTable`` (tests/unit/test_cut_explorer.py), the writer's ``Track`` fields against the real ``Track``
(tests/unit/test_cut_explorer_track.py). Where the model departs from the real code on purpose:

* datasets are finite (``rows`` rows in chunks of ``chunk``, state = rows fetched); a real pass starts again;
* a writer's ``Progress`` report (resume.py:109-119, at most every 50 ms) is sent or not at each chunk, both
  explored while a kill can still come; the deferred-commit thread (procs/pending.py) is not modelled: the writer
  publishes only where its main thread does (before it acquires, while capped or blocked, at each chunk's end:
  ``rows_per_commit`` is one chunk for a buffer under 16 slots, pending.py:46-48, and when paused);
* a writer reads its control messages after every chunk (the real one at most every 1 ms, writer.py:570);
* ``draw_full`` and ``acquire_empty`` take the lowest ids (the real ones: random, and a per-process cursor);
* the first mix's timeout (firstmix.py:376-390, 10 s) fires only when nothing else can move;
* a reader draws one batch per hold (``shuffle_size // (8 * bs)`` is 0 -> 1 for these buffers, reader.py:141);
* ring slots travel as messages in the channels' order, both ways (the real ones through the ring, NOTE [ Slot
  queues ] in shm/slotqueue.py). A batch handed to the caller is freed at once (the real one when the caller drops
  it), seen by the reader at once or at its next look, possibly ahead of a cut message sent before it: a free ring
  slot only lets a reader draw, which it never does between a ``Pause`` and its ``Resume``. A ``BatchReady`` is
  seen by the trainer no later than the next message on that channel (the real trainer takes a reader's
  announcements before each message it reads from it), possibly earlier: the only messages a reader sends before
  an announcement that the trainer acts on are a ``Paused``, after which the reader announces nothing until the
  trainer's ``Resume`` (sent after the cut's listing), and a ``PassEnd``, after which it announces nothing until the
  next ``StartPass``. So the cut's rows are the same in either order;
* one round of ``_writer_states`` (send the requests, pump, take the answers; cut.py:178-194) is one step: a reply
  is read by the next round's pump;
* the supervisor's pump (supervisor.py:174-185) is one step: it reads every message waiting on every channel,
  then the zygote's exit reports. A message sent while the real pump drains another channel is, here, sent
  just before or just after the pump;
* a send to a killed child fails (EPIPE: cut.py:185-186, 220-221, 248-249); writers and readers always restart;
* not modelled: ``state_dict(unconsumed=...)`` (the ``handed`` batches and copies saved as rows), elastic loads
  (re-splits, rereads in the trainer), the ``LoadState`` path of a running writer (a resume is the start of a
  run: ``saved``, ``resumed_filter``), a table the trainer cannot map (``table_for_cut`` fails closed), a failure
  of Redis; a trainer never dies. With two trainers a cut's barrier timeout (cutbarrier.py) is a step enabled
  while the other rank is not in that cut; the model's barrier is the Lua rule without the ``ahead`` refusal.
  Two trainers with a Ctrl-C on one of them are not explored: the interrupted rank's second ``state_dict()``
  has no partner (the ranks' checkpoint numbers drift, issue 32's fourth hole), so the model gets stuck.

Size. The explored worlds grow fast: one rank with one writer and one reader, or two writers without kills,
are explored whole in seconds (tests/unit/test_cut_explorer.py prints the figures: worlds, steps, final worlds
checked, kill and interrupt steps and, for a whole exploration, the interleavings: step sequences from the start
to a checked end, counted over the graph of worlds). Two ranks are explored only up to a bound of worlds
(``explore(bounded=True)``), from the start where the writers filled the buffer; where a bounded depth-first
search would spend its bound below the first kill it takes, ``sweep`` takes a kill (or Ctrl-C) at each step of
one seeded schedule and explores a bounded neighbourhood after each. No partial-order reduction is done; the
memo of seen worlds is what keeps the search finite (two writers with a kill: past 1.2M worlds, not complete).

Mutations (each a flag of ``Config``) put back a bug the real code had or could have; the tests assert that the
explorer finds each (a failing interleaving, printed as a trace) and none without them, in each way where it
can matter: (a) the first-mix wait answers from the chunk's start, by positions only with a filter (else the
rows past the answered head are found, dropped from ``keep`` and read again: once); (e) LISTED does not exist in
the positions way.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

# The pure functions of the writer's side of the positions way are driven as they are (procs/positions.py).
from gigashuffle.procs.positions import LANE_SHIFT, NO_ORIGIN, ROW_MASK, filtered_commits, folded
from gigashuffle.rowblock import share_bounds
from model import table as tm
from model.table import Ids, ModelError, Row, Table

Msg = tuple[Any, ...]  # ("Kind", fields...): the messages of procs/messages.py the cut uses
PAUSED, LISTED, COPIED = 1, 2, 3  # cutbarrier.py:295


class Config(NamedTuple):
    trainers: int = 1  # local ranks of the node (local rank 0 lists and copies the buffer, cut.py:88)
    writers: int = 2  # per trainer
    readers: int = 1  # per trainer
    rows: int = 3  # rows of each writer's stream
    chunk: int = 2  # rows per chunk
    slots: int = 4  # the node buffer
    bs: int = 2
    depth: int = 2  # ring slots per reader
    min_full: int = 2  # readers draw nothing below it; the first mix's share is ceil(min_full / node writers)
    saved: int = 0  # a resumed run: rows each rank's writers put back first, dealt (rows of the pass)
    kills: int = 1  # SIGKILLs per run, of any writer or reader, at any step
    interrupts: int = 1  # KeyboardInterrupts per run, at any step of a trainer's cut
    checkpoints: int = 1  # checkpoints each trainer takes (one more after each aborted cut)
    # A KeyboardInterrupt also between the statements of the cut's ``finally``: the rest of the finally is skipped
    # (readers or writers left paused, CutState.end not run). The real cut can no longer be cut there (it is one
    # blocking section: a Ctrl-C is raised only at its waits), so this explores a stronger property than needed.
    finally_interrupts: bool = False
    # A bound for two trainers: a trainer that has a checkpoint to take takes it before it pumps or delivers
    # anything (its children still move in every order before and during its cut).
    eager_cut: bool = False
    # The positions way (``checkpoint_rows="positions"``, NOTE [ Positions checkpoint ]): writers stamp origins and
    # keep the states of their chunks begun within ``keep_rows`` of their own rows (KEEP_BUFFERS * shuffle_size;
    # 0: ``slots``); the cut collects the unconsumed stream rows per lane instead of saving them.
    positions: bool = False
    keep_rows: int = 0
    # A run resumed from a positions checkpoint: writer 0 of each rank starts from stream row ``at`` (its state)
    # with the filter (keep, until) in absolute stream rows (``start_of``): it writes the rows of ``keep`` and
    # every row from ``until`` on; the rest were consumed before.
    resumed_filter: tuple[int, tuple[int, ...], int] | None = None
    # Mutations: each puts back one bug.
    answer_from_chunk_start: bool = False  # (a) commit 171b336: the first-mix wait answers without its ``done``
    stale_paused: bool = False  # (b) commit 82d4221: a Paused counts whatever cut it answered
    begin_keeps_paused: bool = False  # (i) CutState.begin does not forget the readers an aborted cut saw paused
    skip_copied: bool = False  # (c) the cut does not wait at the node barrier COPIED
    no_respawn_skip: bool = False  # (d) a respawned writer does not skip the rows its predecessor committed
    skip_listed: bool = False  # (e) the cut does not wait at the node barrier LISTED
    skip_paused: bool = False  # (f) the cut does not wait at the node barrier PAUSED
    every_rank_saved: bool = False  # (g) load_state_dict puts back every rank's saved rows on every rank
    drop_old_rows: bool = False  # (h) by positions: rows older than every kept state are not saved as rows


class Writer(NamedTuple):
    rank: int
    ix: int  # the writer or reader index (not ``index``: a tuple method)
    seq: int  # the zygote's spawn number (ChildProcess.seq)
    pid: int
    go: bool = True  # ChildSpec.go (childspecs.py:79): False when spawned during a cut
    alive: bool = True
    pc: str = "start"
    ret: str = ""  # where a control wait returns
    inbox: tuple[Msg, ...] = ()
    out: tuple[Msg, ...] = ()
    # StreamPosition (procs/resume.py:57-80)
    serial: int = 0
    produced: int = 0
    skip_left: int = 0
    base: int = 0
    started: bool = False
    chunk_state: int = 0
    done: int | None = None
    paused: bool = False
    restore: tuple[Row, ...] | None = None
    restored: int = 0
    counter: tuple[int, int, int] = (0, 0, 0)  # [serial, stream base, saved base]: shared memory the trainer reads
    ds: int = 0  # the dataset's state: rows fetched (its state_dict())
    chunk: tuple[Row, ...] | None = None
    reserved: Ids = ()  # _Reservation
    pending: Ids = ()  # PendingRows
    lane: int = -1  # PendingRows.lane
    mix_written: int = 0  # FirstMix
    mix_lifted: bool = True
    wrows: tuple[Row, ...] = ()  # write(): the rows, the local ``done``, ``saved``
    wdone: int = 0
    wsaved: bool = False
    # Track (procs/positions.py): its base, kept states (stream row, state), filter, the current chunk's numbering
    tbase: int = 0
    retained: tuple[tuple[int, int], ...] = ()
    fkeep: tuple[int, ...] = ()
    funtil: int = 0
    chunk_first: int = 0
    chunk_rows: tuple[int, ...] | None = None


RingSlot = tuple[tuple[Row, ...], int, tuple[int, ...]]


class Reader(NamedTuple):
    rank: int
    ix: int  # the writer or reader index (not ``index``: a tuple method)
    seq: int
    pid: int
    alive: bool = True
    pc: str = "start"
    inbox: tuple[Msg, ...] = ()
    out: tuple[Msg, ...] = ()
    free: tuple[int, ...] = ()
    ring: tuple[RingSlot, ...] = ()  # per ring slot: its rows, its lane number (ring.seq), the rows' origins
    drawn: Ids | None = None
    released: int = 0  # _Lane.released
    want: int = 0
    pause_cut: int = 0  # a Pause to answer once the batches drawn are announced
    ann: tuple[int, ...] = ()  # ring slots released and not yet announced


class Resume(NamedTuple):  # trainer/resumepoints.py _Writer
    serial: int = 0
    state: int = 0
    skip: int = 0
    reports: tuple[tuple[int, int, int], ...] = ()  # Progress(serial, produced, state)
    saved: tuple[Row, ...] = ()
    mapped: int = -1  # the seq of the writer whose counter is mapped (Attached), -1: none
    positions: tuple[int, tuple[int, ...], int] | None = None  # (stream row of ``state``, keep, until)


class Trainer(NamedTuple):
    rank: int
    pc: str = "train"
    cuts: int = 0  # Supervisor._cuts
    cutting: bool = False  # ChildSpecs.cutting
    paused: frozenset[int] = frozenset()  # Supervisor._paused (reader seqs)
    states: tuple[Msg | None, ...] = ()  # Supervisor._states: per writer index, its last DatasetState
    inbox: tuple[tuple[int, int], ...] = ()  # announced batches (reader seq, ring slot), not handed out
    rings: frozenset[int] = frozenset()  # readers whose RingReady was read (child.ring is not None)
    rp: tuple[Resume, ...] = ()
    serials: int = 1  # ResumePoints._serials
    requests: int = 0  # cut._requests
    go: bool = True
    # the cut in progress (cut.take's locals)
    number: int = 0
    asked: tuple[tuple[int, int] | None, ...] = ()
    answers: tuple[Msg | None, ...] = ()
    r_asked: frozenset[int] = frozenset()
    r_seen: frozenset[int] = frozenset()  # readers asked before the last pump (_ReaderPause._asked vs sup.pumps)
    r_resumed: frozenset[int] = frozenset()
    listed: tuple[Any, ...] = ()
    rows: tuple[Row, ...] = ()
    before: tuple[Row, ...] = ()
    failed: bool = False
    # what the run produced
    delivered: tuple[Row, ...] = ()
    checkpoint: tuple[Any, ...] | None = None  # (before, ((state, skip) per writer), saved rows)
    cuts_left: int = 1


class World(NamedTuple):
    table: Table
    children: tuple[Writer | Reader, ...]
    trainers: tuple[Trainer, ...]
    barrier: tuple[tuple[int, int], ...]  # per local rank: its entry (cut, phase) in the cut hash
    exits: tuple[int, ...]  # seqs of killed children the zygote has not reported yet
    kills: int
    interrupts: int
    next_pid: int
    next_seq: int


# -- layout ------------------------------------------------------------------------------------------------------
def writer_lanes(cfg: Config, rank: int, index: int) -> tuple[int, int]:
    """shm/lanes.py:377-383: a writer's (stream, saved rows) lanes."""
    first = 2 * (rank * cfg.writers + index)
    return first, first + 1


def reader_lane(cfg: Config, rank: int, index: int) -> int:
    """shm/lanes.py:386-391."""
    return 2 * cfg.trainers * cfg.writers + rank * cfg.readers + index


def stream(cfg: Config, rank: int, index: int) -> tuple[Row, ...]:
    return tuple((rank, index, i) for i in range(cfg.rows))


def saved_rows(cfg: Config, rank: int) -> tuple[Row, ...]:
    return tuple((rank, -1, i) for i in range(cfg.saved))


def share(cfg: Config) -> int:
    """firstmix.py:339-346."""
    return math.ceil(cfg.min_full / max(1, cfg.writers * cfg.trainers))


def initial(cfg: Config) -> World:
    lanes = 2 * cfg.trainers * cfg.writers + cfg.trainers * cfg.readers
    w = World(Table.new(cfg.slots, lanes), (), (), ((0, 0),) * cfg.trainers, (), cfg.kills, cfg.interrupts, 1000, 1)
    trainers = []
    everyone = tuple(r for rank in range(cfg.trainers) for r in saved_rows(cfg, rank))
    for rank in range(cfg.trainers):
        # parts.restore: the rank's writers put back its own saved rows, a contiguous share each
        # (RowBlock.dealt); mutation (g) puts back every rank's.
        saved = everyone if cfg.every_rank_saved else saved_rows(cfg, rank)
        dealt = [saved[lo:hi] for lo, hi in share_bounds(len(saved), cfg.writers)]
        f = cfg.resumed_filter
        rp = tuple(
            Resume(saved=dealt[i], state=f[0] if f and i == 0 else 0, positions=f if i == 0 else None)
            for i in range(cfg.writers)
        )
        t = Trainer(rank, states=(None,) * cfg.writers, rp=rp, cuts_left=cfg.checkpoints)
        trainers.append(t)
    w = w._replace(trainers=tuple(trainers))
    for rank in range(cfg.trainers):  # Supervisor.__init__ (supervisor.py:119-121): every child spawned
        for i in range(cfg.writers):
            w = _spawn_writer(cfg, w, rank, i)
        for i in range(cfg.readers):
            w = _spawn_reader(cfg, w, rank, i)
    return w


def _spawn_writer(cfg: Config, w: World, rank: int, index: int) -> World:
    """Supervisor._spawn + ChildSpecs.spec (supervisor.py:155-161, childspecs.py:79) + resume.initial_position."""
    t = w.trainers[rank]
    rp = t.rp[index]
    child = Writer(
        rank, index, w.next_seq, w.next_pid, go=t.go and not t.cutting, serial=rp.serial, skip_left=rp.skip,
        base=rp.state, chunk_state=rp.state, ds=rp.state, restore=rp.saved or None,
        lane=writer_lanes(cfg, rank, index)[0],
    )  # fmt: skip
    # writer.run: ``position.skip_left = track.restart(base, base_state, keep, until, spec.skip)``
    child = _track_restart(cfg, child, rp.positions or (0, (), 0))
    return w._replace(children=(*w.children, child), next_seq=w.next_seq + 1, next_pid=w.next_pid + 1)


def _spawn_reader(cfg: Config, w: World, rank: int, index: int) -> World:
    t = w.trainers[rank]
    inbox: tuple[Msg, ...] = (("Pause", t.cuts),) if t.cutting else ()  # supervisor.py:159-160
    child = Reader(rank, index, w.next_seq, w.next_pid, inbox=inbox)
    return w._replace(children=(*w.children, child), next_seq=w.next_seq + 1, next_pid=w.next_pid + 1)


# -- Track (procs/positions.py), as an immutable value: tests/unit/test_cut_explorer.py checks it against the real one
def _keep_rows(cfg: Config) -> int:
    """``Track(keep_rows=int(KEEP_BUFFERS * shuffle_size))``, at least 1."""
    return max(1, cfg.keep_rows or cfg.slots)


def lane_of(cfg: Config, rank: int, index: int) -> int:
    """procs/positions.py ``lane_of``: the writer's lane in the node (the origin's top bits)."""
    return rank * cfg.writers + index


def _filtering(c: Writer) -> bool:
    """``Track.filtering``."""
    return c.funtil > c.tbase or len(c.fkeep) > 0


def _track_restart(cfg: Config, c: Writer, positions: tuple[int, tuple[int, ...], int]) -> Writer:
    """``Track.restart(base, state, keep, until, skip)``: the skip is folded into a filter (``folded``, real)."""
    base, keep, until = positions
    c = c._replace(tbase=base, retained=((base, c.base),) if cfg.positions else (), chunk_rows=None)
    if not (len(keep) or until > base):
        return c._replace(fkeep=(), funtil=0)
    k, u = folded(np.asarray(keep, dtype=np.int64), until, base, c.skip_left)
    return c._replace(fkeep=tuple(int(x) for x in k), funtil=int(u), skip_left=0)


def _before_chunk(cfg: Config, c: Writer) -> Writer:
    """``Track.before_chunk(position.produced, position.chunk_state)`` (writer.py ``_before_fetch``)."""
    if not cfg.positions:
        return c
    row = c.tbase + c.produced
    retained = list(c.retained)
    if retained and retained[-1][0] == row:
        retained.pop()
    retained.append((row, c.chunk_state))
    while len(retained) > 1 and retained[1][0] <= row - _keep_rows(cfg):
        retained.pop(0)
    return c._replace(retained=tuple(retained))


def _select(c: Writer, produced: int, rows: int, skipped: int) -> tuple[Writer, tuple[int, ...] | None]:
    """``Track.select``: the chunk's rows to write (indices), or None for all from ``skipped`` on."""
    first = c.tbase + produced
    c = c._replace(chunk_first=first)
    if not _filtering(c) or first >= c.funtil:
        return c._replace(fkeep=(), funtil=0, chunk_rows=None), None
    keep = set(c.fkeep)
    chosen = tuple(j for j in range(skipped, rows) if first + j >= c.funtil or first + j in keep)
    return c._replace(chunk_rows=tuple(first + j for j in chosen)), chosen


def _origins(cfg: Config, c: Writer, done: int, n: int) -> tuple[int, ...] | None:
    """``Track.stamp``: the origins of the rows ``done:done+n`` being written (None: not stamped, saved way)."""
    if not cfg.positions:
        return None
    if c.wsaved:
        return (NO_ORIGIN,) * n
    bits = lane_of(cfg, c.rank, c.ix) << LANE_SHIFT
    if c.chunk_rows is None:
        return tuple(bits | (c.chunk_first + done + j) for j in range(n))
    return tuple(bits | r for r in c.chunk_rows[done : done + n])


Where = tuple[int, int, tuple[tuple[int, int], ...], tuple[int, ...], int]  # (at, head, retained, keep, until)


def _track_answer(cfg: Config, c: Writer, skip: int) -> Where | None:
    """``Track.answer(started, produced, skip, done)`` and ``Track.head``."""
    if not cfg.positions and not _filtering(c):
        return None
    at = c.tbase if not c.started else c.chunk_first if c.done is not None else c.tbase + c.produced
    done = c.done if c.started else None
    if done is not None and c.chunk_rows is not None and _filtering(c):
        head = c.chunk_rows[done - 1] + 1 if done else at
    else:
        head = at + skip
    return at, head, c.retained, tuple(k for k in c.fkeep if k >= head), c.funtil


# -- small world updates -----------------------------------------------------------------------------------------
def _put(w: World, i: int, child: Writer | Reader) -> World:
    return w._replace(children=(*w.children[:i], child, *w.children[i + 1 :]))


def _put_trainer(w: World, t: Trainer) -> World:
    return w._replace(trainers=(*w.trainers[: t.rank], t, *w.trainers[t.rank + 1 :]))


def _find(w: World, seq: int) -> int:
    for i, c in enumerate(w.children):
        if c.seq == seq:
            return i
    raise KeyError(seq)


def _send(w: World, seq: int, msg: Msg) -> tuple[World, bool]:
    """A message to a child; False when it is dead (the send raises OSError)."""
    i = _find(w, seq)
    c = w.children[i]
    if not c.alive:
        return w, False
    return _put(w, i, c._replace(inbox=(*c.inbox, msg))), True


def _live(w: World, rank: int, kind: type) -> list[Writer | Reader]:
    """Supervisor.writers()/readers() (supervisor.py:387-391): a killed child is alive to the trainer until its
    exit is handled (``ChildProcess.alive`` is ``exitcode is None``, zygoteclient.py:47-48)."""
    return [c for c in w.children if c.rank == rank and (c.alive or c.seq in w.exits) and isinstance(c, kind)]


def _set_tuple(items: tuple[Any, ...], i: int, value: Any) -> tuple[Any, ...]:
    return (*items[:i], value, *items[i + 1 :])


# -- writers -----------------------------------------------------------------------------------------------------
def _enter_ctrl(c: Writer, ret: str) -> Writer:
    """_handle_control (writer.py:335-346): returns at once when no message waits and the writer is not paused."""
    if not c.inbox and not c.paused:
        return c._replace(pc=ret)
    return c._replace(pc="ctrl", ret=ret)


def _apply(cfg: Config, t: Table, c: Writer, msg: Msg) -> tuple[Table, Writer]:
    """_apply (writer.py:349-390), for the messages of the cut: Go, StateRequest, Resume."""
    kind = msg[0]
    if kind == "Go":
        return t, c._replace(go=True)
    if kind == "Resume":
        return t, c._replace(paused=False)
    if kind != "StateRequest":
        raise ModelError(f"writer got {msg}")
    _, request, pause = msg
    if pause:  # writer.py:378-380: chunks.before_restart() publishes every row copied
        t = tm.commit(t, c.pid, c.pending, c.lane)
        c = c._replace(pending=(), paused=True)
    if not c.started:  # StreamPosition.answer (resume.py:130-137)
        state, skip = c.base, c.skip_left
    elif c.done is not None:
        state, skip = c.chunk_state, c.done
    else:
        state, skip = c.ds, c.skip_left
    leftover = c.restore[c.restored :] if c.restore is not None else ()  # resume.py:139-144
    where = _track_answer(cfg, c, skip)  # chunks.track.answer(started, produced, skip, done)
    return t, c._replace(out=(*c.out, ("DatasetState", request, c.ix, state, skip, leftover, where)))


def _mix_allowed(cfg: Config, t: Table, c: Writer, n: int) -> tuple[int, Writer]:
    """FirstMix.allowed (firstmix.py:366-391), without the timeout (a separate step, see ``_mix_timeout``)."""
    if c.mix_lifted:
        return n, c
    left = share(cfg) - c.mix_written
    if left > 0:
        return min(n, left), c
    if t.read > 0:
        return n, c._replace(mix_lifted=True)
    return 0, c


def _settle(cfg: Config, c: Writer) -> Writer:
    """The writer's purely local moves between two steps of ``_write_forever`` (writer.py:546-574)."""
    while True:
        if c.pc == "loop":
            if c.restore is not None:  # writer.py:547-548, _write_back (577-601)
                if c.pending:
                    return c  # its publish is a step
                lanes = writer_lanes(cfg, c.rank, c.ix)
                c = c._replace(lane=lanes[1], wrows=c.restore, wdone=0, wsaved=True, pc="write")
            elif c.chunk is not None:
                c = _take(c)
            else:
                return c._replace(pc="fetch")
        elif c.pc == "write" and c.wdone >= len(c.wrows):
            c = c._replace(pc="wb_end" if c.wsaved else "chunk_end")
        else:
            return c


def _take(c: Writer) -> Writer:
    """StreamPosition.take (resume.py:121-128), Track.select and the call of write() (writer.py
    ``_write_forever``): all rows from the skipped on, or a resumed writer's chosen rows from 0."""
    rows = c.chunk or ()
    skipped = min(c.skip_left, len(rows))
    produced = c.produced
    c = c._replace(started=True, skip_left=c.skip_left - skipped, produced=produced + len(rows), done=skipped)
    c, chosen = _select(c, produced, len(rows), skipped)
    if chosen is None:
        return c._replace(wrows=rows, wdone=skipped, wsaved=False, pc="write")
    return c._replace(wrows=tuple(rows[j] for j in chosen), wdone=0, wsaved=False, pc="write")


def _writer_step(cfg: Config, w: World, i: int, report: bool) -> World | None:
    c = w.children[i]
    assert isinstance(c, Writer)
    t = w.table
    pc = c.pc
    lanes = writer_lanes(cfg, c.rank, c.ix)
    if pc == "start":
        # run() and _run() (writer.py:393-454): _before_fetch (its first report is always due), the first chunk,
        # bind() (resume.py:86-96: the bases from the lanes) and Attached; then _hold unless go.
        c = _before_chunk(cfg, c._replace(chunk_state=c.ds))
        rows = stream(cfg, c.rank, c.ix)[c.ds : c.ds + cfg.chunk]
        counter = (c.serial, t.lanes[lanes[0]] - c.skip_left, t.lanes[lanes[1]])
        out = (*c.out, ("Progress", c.serial, 0, c.ds), ("Attached",))
        lifted = cfg.writers * cfg.trainers <= 1 or t.read > 0  # FirstMix.__init__ (firstmix.py:359)
        c = c._replace(chunk=rows or None, ds=c.ds + len(rows), chunk_state=c.ds, counter=counter, out=out,
                       mix_lifted=lifted, pc="loop" if c.go else "hold")  # fmt: skip
        return _put(w, i, _settle(cfg, c))
    if pc in ("hold", "ctrl", "idle"):
        # _hold (writer.py:465-474), _handle_control (335-346): one message per step; a paused writer waits.
        if not c.inbox:
            return None
        t, c = _apply(cfg, t, c._replace(inbox=c.inbox[1:]), c.inbox[0])
        if pc == "hold" and c.go and not c.paused and not c.inbox:
            c = c._replace(pc="loop", mix_lifted=cfg.writers * cfg.trainers <= 1 or t.read > 0)
        elif pc == "ctrl" and not c.paused and not c.inbox:
            c = c._replace(pc=c.ret)
        return _put(w._replace(table=t), i, _settle(cfg, c))
    if pc == "loop":  # _write_back's first publish, on the stream lane (writer.py:591)
        t = tm.commit(t, c.pid, c.pending, c.lane)
        return _put(w._replace(table=t), i, _settle(cfg, c._replace(pending=())))
    if pc == "fetch":
        # _before_fetch (writer.py:457-462, resume.py:109-119) and chunks.next(): the report when due.
        out = (*c.out, ("Progress", c.serial, c.produced, c.ds)) if report else c.out
        rows = stream(cfg, c.rank, c.ix)[c.ds : c.ds + cfg.chunk]
        c = _before_chunk(cfg, c._replace(chunk_state=c.ds, out=out))
        if not rows:  # the model's pass is over: publish, give back, answer the trainer (as _Chunks._idle)
            return _put(w, i, c._replace(pc="end", chunk=None))
        c = _take(c._replace(chunk=rows, ds=c.ds + len(rows)))
        return _put(w, i, _settle(cfg, c))
    if pc == "end":
        if (step := _publish_then_give_back(w, i, c)) is not None:
            return step
        return _put(w, i, c._replace(pc="idle"))
    if pc == "write":
        return _write_step(cfg, w, i, c)
    if pc == "wb_end":  # _write_back (writer.py:595-600): publish on the saved lane, then the stream's again
        t = tm.commit(t, c.pid, c.pending, c.lane)
        c = c._replace(pending=(), lane=lanes[0], restore=None, restored=0, pc="loop")
        return _put(w._replace(table=t), i, _settle(cfg, c))
    if pc == "chunk_end":
        # writer.py:565-574: done=None; publish_and_reserve when rows are pending or the reservation is short
        # (rows_per_commit is the chunk for these buffers); then the trainer's messages.
        n_rows = len(c.chunk or ())  # the chunk's rows, all of them even when a filter chose fewer
        reserved = c.reserved
        if c.pending or len(reserved) < n_rows:
            n = n_rows - len(reserved)
            if n <= 0:
                t = tm.commit(t, c.pid, c.pending, c.lane)
            else:
                t, fresh = tm.commit_acquire(t, c.pid, c.pending, n, cfg.min_full, c.lane)
                reserved = (*reserved, *fresh)
        c = c._replace(done=None, pending=(), reserved=reserved, chunk=None)
        return _put(w._replace(table=t), i, _enter_ctrl(c, "fetch"))
    raise ModelError(f"writer pc {pc}")


def _publish_then_give_back(w: World, i: int, c: Writer) -> World | None:
    """pending.publish() then reserved.give_back(), a step each; None once neither has anything left."""
    t = w.table
    if c.pending:
        t = tm.commit(t, c.pid, c.pending, c.lane)
        return _put(w._replace(table=t), i, c._replace(pending=()))
    if c.reserved:
        t = tm.give_back(t, c.pid, c.reserved)
        return _put(w._replace(table=t), i, c._replace(reserved=()))
    return None


def _serve_trainer(cfg: Config, c: Writer) -> Writer:
    """serve_trainer (writer.py:499-507): the rows ``:done`` count as in the buffer, then the messages."""
    if c.wsaved:
        c = c._replace(restored=c.wdone)
    elif not (cfg.answer_from_chunk_start and c.mix_written >= share(cfg) and not c.mix_lifted):
        c = c._replace(done=c.wdone)
    return _enter_ctrl(c, "write")


def _write_step(cfg: Config, w: World, i: int, c: Writer) -> World | None:
    """One step of write() (writer.py:509-544)."""
    t = w.table
    allowed, c = _mix_allowed(cfg, t, c, len(c.wrows) - c.wdone)
    if not allowed:  # writer.py:515-523: publish, give back, serve the trainer, back off
        if (step := _publish_then_give_back(w, i, c)) is not None:
            return step
        return _put(w, i, _serve_trainer(cfg, c))
    if not c.reserved:  # writer.py:524-535
        if c.pending:
            t = tm.commit(t, c.pid, c.pending, c.lane)
            return _put(w._replace(table=t), i, c._replace(pending=()))
        t, got = tm.acquire(t, c.pid, allowed)
        if not got:  # blocked on the readers
            return _put(w, i, _serve_trainer(cfg, c))
        return _put(w._replace(table=t), i, c._replace(reserved=got))
    slots = c.reserved[:allowed]  # writer.py:536-542: copy, pending, the first mix's count
    t = tm.write_rows(t, c.pid, slots, c.wrows[c.wdone : c.wdone + len(slots)], _origins(cfg, c, c.wdone, len(slots)))
    c = c._replace(reserved=c.reserved[len(slots) :], pending=(*c.pending, *slots), wdone=c.wdone + len(slots),
                   mix_written=c.mix_written + len(slots))  # fmt: skip
    return _put(w._replace(table=t), i, _settle(cfg, c))


def _mix_capped(cfg: Config, w: World, c: Writer) -> bool:
    return (
        c.alive and c.pc == "write" and not c.mix_lifted and c.mix_written >= share(cfg) and w.table.read == 0
        and not c.pending and not c.reserved
    )  # fmt: skip


# -- readers -----------------------------------------------------------------------------------------------------
def _reader_step(cfg: Config, w: World, i: int) -> World | None:
    c = w.children[i]
    assert isinstance(c, Reader)
    t = w.table
    lane = reader_lane(cfg, c.rank, c.ix)
    if c.pc == "start":  # _open_ring (reader.py:73-87), _Lane (223-226), the ring's slots all free
        c = c._replace(out=(*c.out, ("RingReady",)), released=t.lanes[lane], free=tuple(range(cfg.depth)),
                       ring=(((), 0, ()),) * cfg.depth, pc="loop")  # fmt: skip
        return _put(w, i, c)
    if c.pc == "loop":  # _stream (reader.py:148-169): the frees and cut messages waiting, then a draw
        msgs, free = c.inbox, list(c.free)
        cut_msgs = []
        for m in msgs:
            if m[0] == "FreeSlot":
                free.extend(m[1])
            elif m[0] in ("Pause", "Resume"):
                cut_msgs.append(m)
        c = c._replace(inbox=(), free=tuple(free))
        if cut_msgs and cut_msgs[-1][0] == "Pause":  # _pausing (246-250)
            cut = cut_msgs[-1][1]
            if c.drawn is not None:
                return _put(w, i, c._replace(pc="announce", want=0, pause_cut=cut))
            return _put(w, i, c._replace(out=(*c.out, ("Paused", cut)), pc="paused"))
        drawn = c.drawn
        if drawn is None:
            if not free:
                return _put(w, i, c) if msgs else None
            t, ids = tm.draw(t, c.pid, cfg.bs, cfg.min_full)  # draw_batches (269-275): one batch (see above)
            drawn = ids or None
            if drawn is None:
                return _put(w._replace(table=t), i, c) if msgs else None
        want = min(len(free) - len(drawn) // cfg.bs, 1) * cfg.bs
        return _put(w._replace(table=t), i, c._replace(drawn=drawn, want=want, pc="announce"))
    if c.pc == "announce":  # _announce (reader.py:172-217) up to the release: gather, number, release (and draw)
        drawn = c.drawn or ()
        batches = len(drawn) // cfg.bs
        ks, rest = c.free[:batches], c.free[batches:]
        ring = list(c.ring)
        for b, k in enumerate(ks):
            rows = tuple(t.row[s] for s in drawn[b * cfg.bs : (b + 1) * cfg.bs])
            if any(r is None for r in rows):
                raise ModelError(f"reader gathered a slot never written: {drawn}")
            origins = tuple(t.origin[s] for s in drawn[b * cfg.bs : (b + 1) * cfg.bs]) if cfg.positions else ()
            ring[k] = (rows, c.released + b + 1, origins)  # type: ignore[assignment]  # _Lane.number (228-233)
        t = tm.release(t, c.pid, drawn, lane, batches)
        following: Ids | None = None
        if c.want > 0:  # release_and_draw: the next batch in the same hold
            t, ids = tm.draw(t, c.pid, c.want, cfg.min_full)
            following = ids or None
        c = c._replace(ring=tuple(ring), free=rest, released=c.released + batches, drawn=following, ann=ks,
                       pc="send")  # fmt: skip
        return _put(w._replace(table=t), i, c)
    if c.pc == "send":  # reader.py:216 BatchReady; from a pause, then _pause's Paused (256)
        out = (*c.out, ("BatchReady", c.ann))
        if c.pause_cut:
            return _put(w, i, c._replace(out=(*out, ("Paused", c.pause_cut)), pause_cut=0, ann=(), pc="paused"))
        return _put(w, i, c._replace(out=out, ann=(), pc="loop"))
    if c.pc == "paused":  # _pause (reader.py:253-266)
        if not c.inbox:
            return None
        frees, outs, paused = list(c.free), list(c.out), True
        for m in c.inbox:
            if m[0] == "FreeSlot":
                frees.extend(m[1])
            elif m[0] == "Resume":
                paused = False
            elif m[0] == "Pause":
                outs.append(("Paused", m[1]))
                paused = True
        c = c._replace(inbox=(), free=tuple(frees), out=tuple(outs), pc="paused" if paused else "loop")
        return _put(w, i, c)
    raise ModelError(f"reader pc {c.pc}")


# -- the trainer -------------------------------------------------------------------------------------------------
def _pump(cfg: Config, w: World, rank: int) -> World:
    """Supervisor._pump (supervisor.py:174-185): every message waiting from this rank's children, then exits."""
    for i, c in enumerate(w.children):
        if c.rank == rank and c.out:
            msgs = c.out
            w = _put(w, i, c._replace(out=()))
            for m in msgs:
                w = _on_message(cfg, w, rank, w.children[i], m)
    for seq in w.exits:
        c = w.children[_find(w, seq)]
        if c.rank == rank:
            w = _on_exit(cfg, w._replace(exits=tuple(s for s in w.exits if s != seq)), rank, c)
    t = w.trainers[rank]
    return _put_trainer(w, t._replace(r_seen=t.r_asked)) if t.r_seen != t.r_asked else w


def _on_message(cfg: Config, w: World, rank: int, c: Writer | Reader, m: Msg) -> World:
    """Supervisor._on_message (supervisor.py:206-236)."""
    t = w.trainers[rank]
    kind = m[0]
    if kind == "RingReady":
        t = t._replace(rings=t.rings | {c.seq})
    elif kind == "BatchReady":  # Inbox.announced (inbox.py:109-113): the ring's numbers zeroed
        t = t._replace(inbox=(*t.inbox, *((c.seq, k) for k in m[1])))
        w = _zero_numbers(w, c.seq, m[1])
    elif kind == "Attached":  # ResumePoints.on_attached (resumepoints.py:70-80)
        t = t._replace(rp=_set_tuple(t.rp, c.ix, t.rp[c.ix]._replace(mapped=c.seq)))
    elif kind == "Progress":  # on_report (82-85)
        rp = t.rp[c.ix]
        if m[1] == rp.serial:
            t = t._replace(rp=_set_tuple(t.rp, c.ix, rp._replace(reports=(*rp.reports, m[1:]))))
    elif kind == "DatasetState":
        t = t._replace(states=_set_tuple(t.states, m[2], m))
    elif kind == "Paused":  # supervisor.py:228-230 (before 82d4221: counted whatever its cut)
        if (m[1] == t.cuts and t.cutting) or (cfg.stale_paused and t.cutting):
            t = t._replace(paused=t.paused | {c.seq})
    else:
        raise ModelError(f"trainer got {m}")
    return _put_trainer(w, t)


def _zero_numbers(w: World, seq: int, ks: tuple[int, ...]) -> World:
    i = _find(w, seq)
    c = w.children[i]
    assert isinstance(c, Reader)
    ring = tuple((rows, 0, o) if k in ks else (rows, n, o) for k, (rows, n, o) in enumerate(c.ring))
    return _put(w, i, c._replace(ring=ring))


def _on_exit(cfg: Config, w: World, rank: int, c: Writer | Reader) -> World:
    """Supervisor._on_exit (supervisor.py:263-296): recover a reader's batches, a writer's resume point, repair,
    spawn again."""
    t = w.trainers[rank]
    if isinstance(c, Reader):
        lane = reader_lane(cfg, rank, c.ix)
        if c.seq in t.rings:  # _recover_batches (298-306), Inbox.recover (inbox.py:115-124)
            value = w.table.lanes[lane]
            found = sorted((n, k) for k, (_rows, n, _o) in enumerate(c.ring) if 0 < n <= value)
            ks = tuple(k for _n, k in found)
            t = t._replace(inbox=(*t.inbox, *((c.seq, k) for k in ks)))
            w = _zero_numbers(w, c.seq, ks)
    else:
        t = _on_death(cfg, w, t, c)
    w = _put_trainer(w._replace(table=tm.repair(w.table, c.pid)), t)
    if isinstance(c, Reader):
        return _spawn_reader(cfg, w, rank, c.ix)
    return _spawn_writer(cfg, w, rank, c.ix)


def _on_death(cfg: Config, w: World, t: Trainer, c: Writer) -> Trainer:
    """ResumePoints.on_death (resumepoints.py:87-120)."""
    rp = t.rp[c.ix]
    if rp.mapped == c.seq:
        serial, stream_base, saved_base = c.counter
        lanes = writer_lanes(cfg, c.rank, c.ix)
        committed = w.table.lanes[lanes[0]] - stream_base
        restored = w.table.lanes[lanes[1]] - saved_base
        # With a filter the lane counts rows written: filtered_commits (real) maps it to stream rows.
        base, keep, until = rp.positions or (0, (), 0)
        got, k, u = filtered_commits(base, np.asarray(keep, dtype=np.int64), until, rp.skip, committed)
        committed, keep, until = int(got), tuple(int(x) for x in k), int(u)
        if serial == rp.serial:
            rp = rp._replace(saved=rp.saved[restored:])
            best = max((r for r in rp.reports if r[1] <= committed), key=lambda r: r[1], default=None)
            if best is not None:
                rp = rp._replace(state=best[2], skip=0 if cfg.no_respawn_skip else committed - best[1],
                                 positions=(base + best[1], keep, until))  # fmt: skip
            else:
                rp = rp._replace(skip=0 if cfg.no_respawn_skip else committed, positions=(base, keep, until))
    rp = rp._replace(serial=t.serials, reports=(), mapped=-1)
    return t._replace(rp=_set_tuple(t.rp, c.ix, rp), serials=t.serials + 1)


_PHASE = {"b_paused": PAUSED, "b_listed": LISTED, "b_copied": COPIED}
_FINALLY_PCS = ("finally", "f_writers", "f_end")
_CUT_PCS = ("c_ask", "r_wait", "b_paused", "list", "plist", "b_listed", "r_resume", "copy", "b_copied")


def _skipped(cfg: Config, pc: str) -> bool:
    return {"b_paused": cfg.skip_paused, "b_listed": cfg.skip_listed, "b_copied": cfg.skip_copied}[pc]


def _barrier_missing(cfg: Config, w: World, rank: int, number: int, phase: int) -> bool:
    """lua.CUT_ARRIVE (control/lua.py:130-162): an entry counts if its cut is later, or the same and its phase is
    at least this one. (A rank that gave its cut up, phase 0, fails the others' waits at their next poll: the
    "barrier timeout" move below, taken at once, so the model's timeout covers it.)"""
    return any(
        r != rank and not (cut > number or (cut == number and p >= phase)) for r, (cut, p) in enumerate(w.barrier)
    )


def _barrier(cfg: Config, w: World, t: Trainer, phase: int, then: str, skip: bool) -> World | None:
    """_wait (cut.py:146-149) / NodeBarrier.wait (cutbarrier.py:326-339): arrive; go on, or pump."""
    if cfg.trainers == 1 or skip:
        return _put_trainer(w, t._replace(pc=then))
    w = w._replace(barrier=_set_tuple(w.barrier, t.rank, (t.number, phase)))
    if not _barrier_missing(cfg, w, t.rank, t.number, phase):
        return _put_trainer(w, t._replace(pc=then))
    return _pump(cfg, w, t.rank)


def _trainer_step(cfg: Config, w: World, rank: int, action: str) -> World | None:
    t = w.trainers[rank]
    if action == "pump":
        return _pump(cfg, w, rank)
    if action == "deliver":  # Inbox.pop/hand_over: the caller gets the ring slot's rows, then frees it
        seq, k = t.inbox[0]
        reader = w.children[_find(w, seq)]
        assert isinstance(reader, Reader)
        rows = reader.ring[k][0]
        t = t._replace(inbox=t.inbox[1:], delivered=tuple(sorted((*t.delivered, *rows))))
        w, _ok = _send(_put_trainer(w, t), seq, ("FreeSlot", (k,)))
        return w
    if action == "interrupt" and t.pc in _FINALLY_PCS:  # inside the finally: the rest of it is skipped
        return _put_trainer(w._replace(interrupts=w.interrupts - 1), t._replace(pc="train"))
    if action == "interrupt":  # a KeyboardInterrupt: cut.take's finally
        return _put_trainer(w._replace(interrupts=w.interrupts - 1), t._replace(pc="finally", failed=True))
    if action == "timeout":  # NodeBarrier.wait past its deadline: CheckpointError, the same finally
        return _put_trainer(w, t._replace(pc="finally", failed=True))
    pc = t.pc
    if pc == "train":  # state_dict(): next_number then cut.take; CutState.begin forgets earlier Paused answers
        t = t._replace(cuts=t.cuts + 1, number=t.cuts + 1, cutting=True, asked=(None,) * cfg.writers,
                       paused=t.paused if cfg.begin_keeps_paused else frozenset(),
                       answers=(None,) * cfg.writers, r_asked=frozenset(), r_seen=frozenset(), r_resumed=frozenset(),
                       listed=(), rows=(), before=t.delivered, failed=False, pc="c_ask")  # fmt: skip
        return _put_trainer(w, t)
    if pc == "c_ask":
        # One round of _writer_states (cut.py:178-194): ask the writers not asked and the readers, pump, take the
        # answers to this cut's requests. (A reply to this round's request is read by the next round's pump.)
        asked = list(t.asked)
        requests = t.requests
        for c in _live(w, rank, Writer):
            if t.answers[c.ix] is not None or (asked[c.ix] or (-1, 0))[0] == c.seq:
                continue
            requests += 1
            w, ok = _send(w, c.seq, ("StateRequest", requests, True))
            if ok:
                asked[c.ix] = (c.seq, requests)
        t = t._replace(asked=tuple(asked), requests=requests)
        w, t = _ask_readers(w, t)
        w = _pump(cfg, w, rank)
        t = w.trainers[rank]
        answers = list(t.answers)
        for index, a in enumerate(t.asked):
            s = t.states[index]
            if a is not None and s is not None and s[1] == a[1]:
                answers[index] = s
        done = all(a is not None for a in answers)
        return _put_trainer(w, t._replace(answers=tuple(answers), pc="r_wait" if done else "c_ask"))
    if pc == "r_wait":  # _ReaderPause.wait (cut.py:226-237)
        w, t = _ask_readers(w, t)
        # A reader without a ring counts once a pump ran after its Pause went out (cut.py, _ReaderPause.wait).
        if all(c.seq in t.paused if c.seq in t.rings else c.seq in t.r_seen for c in _live(w, rank, Reader)):
            return _put_trainer(w, t._replace(pc="b_paused"))
        return _pump(cfg, _put_trainer(w, t), rank)
    if pc == "b_paused":
        return _barrier(cfg, w, t, PAUSED, "plist" if cfg.positions else "list", cfg.skip_paused)
    if pc == "plist":  # SavedRows.list_rows with positions.Coverage: the unconsumed stream rows found, the rest
        found, taken, ids = _cut_rows(cfg, w, t)  # a ring batch's rows saved are copied as listed (fancy indexing)
        return _put_trainer(w, t._replace(listed=(taken, (), ids, found), pc="b_listed"))
    if pc == "list":  # SavedRows.list_rows (savedrows.py): leftovers, announced batches, full slots
        leftovers = tuple(r for a in t.answers for r in (a[5] if a is not None else ()))
        ids = tm.full_ids(w.table) if rank == 0 else ()
        return _put_trainer(w, t._replace(listed=(leftovers, t.inbox, ids, ()), pc="b_listed"))
    if pc == "b_listed":
        return _barrier(cfg, w, t, LISTED, "r_resume", cfg.skip_listed)
    if pc == "r_resume":  # cut.py:119 readers.resume()
        w, t = _resume_readers(w, t)
        return _put_trainer(w, t._replace(pc="copy"))
    if pc == "copy":  # Listed.copy (savedrows.py:129-138, copy_rows 141-149): the bytes as they are now
        leftovers, batches, ids, _found = t.listed
        copied: list[Row | None] = [w.table.row[i] for i in ids]
        for seq, k in batches:
            reader = w.children[_find(w, seq)]
            assert isinstance(reader, Reader)
            copied.extend(reader.ring[k][0])
        copied.extend(leftovers)
        return _put_trainer(w, t._replace(rows=tuple(r for r in copied if r is not None), pc="b_copied"))
    if pc == "b_copied":
        return _barrier(cfg, w, t, COPIED, "finally", cfg.skip_copied)
    if pc == "finally":  # cut.take's finally: readers.resume()
        w, t = _resume_readers(w, t)
        if cfg.finally_interrupts:  # the finally's statements as steps: a Ctrl-C may land between them
            return _put_trainer(w, t._replace(pc="f_writers"))
        pc = "f_writers"
    if pc == "f_writers":  # Resume to every writer, then Go when the loader goes
        for c in _live(w, rank, Writer):
            w, _ok = _send(w, c.seq, ("Resume",))
        if t.go:  # writers started during the cut started held
            for c in _live(w, rank, Writer):
                w, _ok = _send(w, c.seq, ("Go",))
        if cfg.finally_interrupts:
            return _put_trainer(w, t._replace(pc="f_end"))
        pc = "f_end"
    if pc == "f_end":  # CutState.end: children start unpaused, the paused readers are forgotten; collect's entries
        t = t._replace(cutting=False, paused=frozenset())
        if not t.failed:  # datasetstate.collect: entry_of per answer
            by_lane: dict[int, tuple[int, ...]] = dict(t.listed[3]) if cfg.positions else {}
            states = tuple(_entry_of(cfg, rank, a, by_lane) for a in t.answers if a is not None)
            t = t._replace(checkpoint=(t.before, states, t.rows), cuts_left=t.cuts_left - 1)
        return _put_trainer(w, t._replace(pc="train" if t.cuts_left else "done"))
    raise ModelError(f"trainer pc {pc}")


def _cut_rows(
    cfg: Config, w: World, t: Trainer
) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[Row, ...], tuple[int, ...]]:
    """The listing with positions.Coverage and _covered, row by row: (per lane of this rank, the stream rows found
    at or after its oldest kept state), the rows saved as rows taken now (the answers' leftovers, announced
    batches' rows not covered, any lane) and the full slots to copy later (not covered, of this rank's lanes; on
    local rank 0 also of no lane of the node)."""
    rank = t.rank
    oldest = {}
    for a in t.answers:
        if a is not None and a[6] is not None and a[6][2]:
            oldest[lane_of(cfg, rank, a[2])] = a[6][2][0][0]
    found: dict[int, list[int]] = {lane: [] for lane in oldest}
    rows: list[Row | None] = [r for a in t.answers if a is not None for r in a[5]]
    for seq, k in t.inbox:  # sup.inbox.waiting(): announced, not handed out
        reader = w.children[_find(w, seq)]
        assert isinstance(reader, Reader)
        batch, _n, origins = reader.ring[k]
        rows.extend(r for r, o in zip(batch, origins, strict=True) if classify(cfg, rank, o, oldest, found, False))
    ids = tuple(i for i in tm.full_ids(w.table) if classify(cfg, rank, w.table.origin[i], oldest, found, True))
    return tuple((lane, tuple(f)) for lane, f in found.items()), tuple(r for r in rows if r is not None), ids


def classify(
    cfg: Config, rank: int, origin: int, oldest: dict[int, int], found: dict[int, list[int]], in_buffer: bool
) -> bool:
    """``_covered`` for one origin: a row of a lane of this rank at or after its oldest kept state is found (its
    stream row noted in ``found``) and not saved; else a row in a ring is saved, and a row in the buffer is saved
    if it is of this rank's lanes, or (on local rank 0) of no lane of the node. True: save it as a row.
    tests/unit/test_cut_explorer_track.py checks it against the real ``_covered``."""
    lane, row = origin >> LANE_SHIFT, origin & ROW_MASK
    if lane in oldest and row >= oldest[lane]:
        found[lane].append(row)
        return False
    if cfg.drop_old_rows and lane in oldest:
        return False
    if not in_buffer:
        return True
    own = rank * cfg.writers <= lane < (rank + 1) * cfg.writers
    return own or ((lane < 0 or lane >= cfg.trainers * cfg.writers) and rank == 0)


Entry = tuple[int, tuple[int, ...], int]  # (at, keep offsets, until): a positions entry of the checkpoint


def _entry_of(cfg: Config, rank: int, a: Msg, found: dict[int, tuple[int, ...]]) -> tuple[int, int, Entry | None]:
    """positions.entry_of: (state, skip, entry) of a writer's answer; skip is 0 with an entry (collect)."""
    where: Where | None = a[6]
    if where is None:
        return a[3], a[4], None
    at, head, retained, keep, until = where
    state = a[3]
    rows = sorted(found.get(lane_of(cfg, rank, a[2]), ())) if retained else []
    if rows:
        starts = [r for r, _s in retained]
        at, state = retained[bisect.bisect_right(starts, rows[0]) - 1]
    offsets = sorted([*rows, *keep])
    u = max(head, until) - at
    return state, 0, (at, tuple(k - at for k in offsets if k - at < u), u)


def _ask_readers(w: World, t: Trainer) -> tuple[World, Trainer]:
    """_ReaderPause.ask (cut.py:215-224)."""
    asked = set(t.r_asked)
    for c in _live(w, t.rank, Reader):
        if c.seq not in asked:
            w, ok = _send(w, c.seq, ("Pause", t.number))
            if ok:
                asked.add(c.seq)
    t = t._replace(r_asked=frozenset(asked))
    return _put_trainer(w, t), t


def _resume_readers(w: World, t: Trainer) -> tuple[World, Trainer]:
    """_ReaderPause.resume (cut.py:239-250)."""
    resumed = set(t.r_resumed)
    for c in _live(w, t.rank, Reader):
        if c.seq not in resumed:
            w, ok = _send(w, c.seq, ("Resume",))
            if ok:
                resumed.add(c.seq)
    t = t._replace(r_resumed=frozenset(resumed))
    return _put_trainer(w, t), t


# -- the explorer ------------------------------------------------------------------------------------------------
Move = tuple[str, Callable[[], World | None]]


def moves(cfg: Config, w: World) -> Iterator[Move]:
    """Every step enabled in ``w``: each live child's next step (a writer's fetch with and without its report
    while a kill may still come), a kill of each live child, each trainer's pump, delivery, cut step, interrupt."""
    for i, c in enumerate(w.children):
        if not c.alive:  # a child of a rank whose checkpoint is done still moves (it may write into the buffer)
            continue
        name = f"{'w' if isinstance(c, Writer) else 'r'}{c.rank}.{c.ix}#{c.seq}"
        if isinstance(c, Writer):
            if c.pc == "fetch" and w.kills:
                yield f"{name} fetch, no report", lambda i=i: _writer_step(cfg, w, i, False)  # type: ignore[misc]
            yield f"{name} {c.pc}", lambda i=i: _writer_step(cfg, w, i, True)  # type: ignore[misc]
        else:
            yield f"{name} {c.pc}", lambda i=i: _reader_step(cfg, w, i)  # type: ignore[misc]
        if w.kills and w.trainers[c.rank].pc != "done":  # nobody would handle its exit
            yield f"SIGKILL {name} at {c.pc}", lambda i=i, c=c: _kill(w, i, c)  # type: ignore[misc]
    for t in w.trainers:
        if t.pc == "done":
            continue
        r = t.rank
        eager = cfg.eager_cut and t.pc == "train" and t.cuts_left > 0
        news = any(c.rank == r and c.out for c in w.children) or any(w.children[_find(w, s)].rank == r for s in w.exits)
        if t.pc == "train" and not eager and news:
            yield f"t{r} pump", lambda r=r: _trainer_step(cfg, w, r, "pump")  # type: ignore[misc]
        if t.pc == "train" and t.inbox and not eager:
            yield f"t{r} deliver {t.inbox[0]}", lambda r=r: _trainer_step(cfg, w, r, "deliver")  # type: ignore[misc]
        if t.pc != "train" or t.cuts_left:
            yield f"t{r} {t.pc} (cut {t.number})", lambda r=r: _trainer_step(cfg, w, r, "step")  # type: ignore[misc]
        if (t.pc in _CUT_PCS or (cfg.finally_interrupts and t.pc in _FINALLY_PCS)) and w.interrupts:
            yield f"t{r} KeyboardInterrupt at {t.pc}", lambda r=r: _trainer_step(cfg, w, r, "interrupt")  # type: ignore[misc]
        waiting = t.pc in _PHASE and cfg.trainers > 1 and cfg.interrupts > 0  # only an aborted cut leaves one
        if waiting and _barrier_missing(cfg, w, r, t.number, _PHASE[t.pc]) and not _skipped(cfg, t.pc):
            other = w.trainers[1 - r]
            # the other rank left this cut (it was interrupted, or timed out itself): this one waits in vain
            if other.cuts >= t.number and not (other.pc in _CUT_PCS and other.number == t.number):
                yield f"t{r} barrier timeout", lambda r=r: _trainer_step(cfg, w, r, "timeout")  # type: ignore[misc]


def _kill(w: World, i: int, c: Writer | Reader) -> World:
    """SIGKILL: the child stops where it is; its sends so far stay in its channel, its slots stay held until the
    trainer repairs them; the zygote reports the exit."""
    dead = c._replace(alive=False, inbox=())
    return _put(w._replace(kills=w.kills - 1, exits=(*w.exits, c.seq)), i, dead)


def _mix_timeout(cfg: Config, w: World) -> list[Move]:
    """firstmix.py:376-390: a capped writer lifts its cap after first_mix_wait_s; taken only when stuck."""
    out: list[Move] = []
    for i, c in enumerate(w.children):
        if isinstance(c, Writer) and _mix_capped(cfg, w, c):
            out.append(
                (f"w{c.rank}.{c.ix} first-mix timeout", functools.partial(_put, w, i, c._replace(mix_lifted=True)))
            )
    return out


def check(cfg: Config, w: World) -> str | None:
    """Resume every rank's checkpoint and drain it: rows handed before each ``state_dict()``, plus each rank's
    saved rows (dealt among the rank's writers, who put them back first: parts.restore), plus each writer's stream
    from its state after its skip, must be the pass's rows, each once. None if so, else what is wrong."""
    want: Counter[Row] = Counter()
    got: Counter[Row] = Counter()
    for t in w.trainers:
        want.update(saved_rows(cfg, t.rank))
        for index in range(cfg.writers):
            f = cfg.resumed_filter if index == 0 else None
            want.update(_written(cfg, t.rank, index, f[0] if f else 0, f))
        if t.checkpoint is None:
            return f"rank {t.rank} took no checkpoint"
        before, states, rows = t.checkpoint
        got.update(before)
        got.update(rows)
        for index, (state, skip, entry) in enumerate(states):
            if entry is None:
                got.update(stream(cfg, t.rank, index)[state + skip :])
                continue
            at, keep, until = entry
            if not _loadable(entry):
                return f"rank {t.rank} writer {index}: load_state_dict refuses positions entry {entry} as damaged"
            # start_of: absolute (at, keep + at, at + until); the writer loads ``state`` as stream row ``at``
            got.update(_written(cfg, t.rank, index, state, (at, tuple(k + at for k in keep), at + until)))
    lost = sorted((want - got).elements())
    twice = sorted((got - want).elements())
    if lost or twice:
        return f"lost {lost}, twice {twice}"
    return None


def _written(
    cfg: Config, rank: int, index: int, state: int, start: tuple[int, tuple[int, ...], int] | None
) -> tuple[Row, ...]:
    """The rows a writer started from dataset ``state`` writes: all of them, or with a positions start (stream row
    ``at`` of ``state``; keep, until absolute) those of ``keep`` and every one from ``until`` on."""
    rows = stream(cfg, rank, index)
    if start is None:
        return rows[state:]
    at, keep, until = start
    chosen = sorted({*(r for r in keep if r >= at), *range(max(at, until), at + len(rows) - state)})
    return tuple(rows[state + r - at] for r in chosen if 0 <= state + r - at < len(rows))


def _loadable(entry: Entry) -> bool:
    """positions.checked: at, until >= 0; keep strictly increasing offsets in [0, until)."""
    at, keep, until = entry
    increasing = all(a < b for a, b in itertools.pairwise(keep))
    return at >= 0 and until >= 0 and all(0 <= k < until for k in keep) and increasing


class Result(NamedTuple):
    states: int  # distinct worlds
    transitions: int  # steps taken (edges of the explored graph)
    runs: int  # runs that reached a checkpoint on every rank (distinct final worlds)
    kills: int  # kill steps taken
    interrupts: int  # interrupt steps taken
    seconds: float
    counterexample: list[str] | None  # the trace of a failing run, its last line says what failed
    complete: bool = True  # every reachable world was explored
    interleavings: int | None = None  # step sequences from the start to a checked end (complete explorations)


def successors(cfg: Config, w: World) -> list[tuple[str, World | ModelError]]:
    """The worlds one step away (a step that changes nothing is no step), or the error a step raised."""
    out: list[tuple[str, World | ModelError]] = []
    for name, make in moves(cfg, w):
        try:
            nxt = make()
        except ModelError as exc:
            out.append((name, exc))
            continue
        if nxt is not None and nxt != w:
            out.append((name, nxt))
    if not out:
        for name, make in _mix_timeout(cfg, w):
            nxt = make()
            if nxt is not None:
                out.append((name, nxt))
    return out


def writers_first(cfg: Config) -> World:
    """The initial world after every writer has run until it can go no further alone (a full buffer, its pass
    over, or the first mix): a start for an exploration too large from the very beginning."""
    w = initial(cfg)
    moved = True
    while moved:
        moved = False
        for i, c in enumerate(w.children):
            if isinstance(c, Writer):
                nxt = _writer_step(cfg, w, i, True)
                if nxt is not None and nxt != w:
                    w, moved = nxt, True
    return w


def explore(
    cfg: Config, max_states: int = 2_000_000, bounded: bool = False, trainers_first: bool = False,
    start: World | None = None, seed: int | None = None,
) -> Result:  # fmt: skip
    """Depth-first over every interleaving (each world expanded once); stops at the first counterexample. Past
    ``max_states`` raise, or with ``bounded`` stop there (a partial exploration: ``Result.complete`` is False).
    ``trainers_first``: try the trainers' steps first (the order only decides which counterexample comes first).
    ``start``: explore from this world instead of ``initial(cfg)``. ``seed``: try each world's steps in an order
    drawn from ``random.Random(seed)`` (deterministic; a bounded search so reaches kills at other steps than the
    first ones). A complete exploration also counts the interleavings: the step sequences from the start to a
    checked end (``Result.interleavings``; every world's successors are kept for it, and None if there is a cycle).
    """
    rng = random.Random(seed) if seed is not None else None

    def successors_in_order(w: World) -> list[tuple[str, World | ModelError]]:
        following = successors(cfg, w)
        if rng is not None:
            rng.shuffle(following)
        return following[::-1] if trainers_first else following

    started = time.monotonic()
    first = initial(cfg) if start is None else start
    seen = {first: 0}  # every world seen, numbered
    # per frame: the steps left to try, the step's name, its world's number, the worlds one step away (numbers)
    Frame = tuple[Iterator[tuple[str, World | ModelError]], str, int, list[int]]
    stack: list[Frame] = [(iter(successors_in_order(first)), "", 0, [])]
    transitions = runs = kills = interrupts = 0
    ways: dict[int, int] = {}  # interleavings from a world to a checked end
    cycle = False

    def fail(last: str, why: str) -> Result:
        path = [frame[1] for frame in stack[1:]] + [last, f"FAILED: {why}"]
        return Result(len(seen), transitions, runs, kills, interrupts, time.monotonic() - started, path)

    while stack:
        step = next(stack[-1][0], None)
        if step is None:
            _it, _name, done, after = stack.pop()
            cycle = cycle or any(a not in ways for a in after)  # one still on the stack: a cycle
            ways[done] = sum(ways.get(a, 0) for a in after)
            continue
        name, nxt = step
        if isinstance(nxt, ModelError):
            return fail(name, str(nxt))
        transitions += 1
        kills += name.startswith("SIGKILL")
        interrupts += "KeyboardInterrupt" in name
        known = len(seen)
        number = seen.setdefault(nxt, known)
        stack[-1][3].append(number)
        if number < known:
            continue
        if len(seen) > max_states:
            if bounded:
                return Result(len(seen), transitions, runs, kills, interrupts, time.monotonic() - started, None, False)
            raise RuntimeError(f"more than {max_states} states: make the configuration smaller")
        if all(t.pc == "done" for t in nxt.trainers):
            runs += 1
            problem = check(cfg, nxt)
            if problem is not None:
                return fail(name, f"after the resume: {problem}")
            ways[number] = 1
            continue
        following = successors_in_order(nxt)
        if not following:
            return fail(name, f"stuck: {_describe(nxt)}")
        stack.append((iter(following), name, number, []))
    count = None if cycle else ways[0]
    return Result(len(seen), transitions, runs, kills, interrupts, time.monotonic() - started, None, True, count)


def sweep(cfg: Config, seed: int, bound: int, start: World | None = None) -> Result:
    """A kill (or Ctrl-C) at each step of one schedule, each followed by every interleaving up to ``bound``
    worlds: for configurations too large to explore whole, where a bounded depth-first search would spend its
    bound below the first kill it takes. The schedule is a walk without kills or Ctrl-Cs, each step drawn from
    ``random.Random(seed)``; at each world on it every kill and Ctrl-C step enabled is taken and explored from."""
    rng = random.Random(seed)
    w = initial(cfg) if start is None else start
    began = time.monotonic()
    path: list[str] = []
    states = transitions = runs = kills = interrupts = 0
    while not all(t.pc == "done" for t in w.trainers):
        following = successors(cfg, w)
        calm = []
        for name, nxt in following:
            if isinstance(nxt, ModelError):
                return Result(states, transitions, runs, kills, interrupts, 0.0, [*path, name, f"FAILED: {nxt}"])
            if not (name.startswith("SIGKILL") or "KeyboardInterrupt" in name):
                calm.append((name, nxt))
                continue
            kills += name.startswith("SIGKILL")
            interrupts += "KeyboardInterrupt" in name
            r = explore(cfg, max_states=bound, bounded=True, start=nxt)
            states, transitions, runs = states + r.states, transitions + r.transitions + 1, runs + r.runs
            kills, interrupts = kills + r.kills, interrupts + r.interrupts  # a Ctrl-C after a kill, or a kill after one
            if r.counterexample is not None:
                return Result(states, transitions, runs, kills, interrupts, 0.0, [*path, name, *r.counterexample])
        if not calm:
            return Result(states, transitions, runs, kills, interrupts, 0.0, [*path, f"FAILED: stuck: {_describe(w)}"])
        name, nxt = calm[rng.randrange(len(calm))]
        assert isinstance(nxt, World)
        path.append(name)
        w, transitions = nxt, transitions + 1
    problem = check(cfg, w)
    trace = None if problem is None else [*path, f"FAILED: after the resume: {problem}"]
    return Result(states, transitions, runs + 1, kills, interrupts, time.monotonic() - began, trace, False)


def _describe(w: World) -> str:
    parts = [f"{'w' if isinstance(c, Writer) else 'r'}{c.rank}.{c.ix}#{c.seq}:{c.pc}" for c in w.children if c.alive]
    parts += [f"t{t.rank}:{t.pc}" for t in w.trainers]
    return " ".join(parts) + f" table={w.table.state}"


def report(name: str, r: Result) -> str:
    line = (
        f"{name}: {r.states} states, {r.transitions} steps, {r.runs} final worlds checked, {r.kills} kill steps, "
        f"{r.interrupts} interrupt steps, {r.seconds:.1f} s{'' if r.complete else ' (bounded: not complete)'}"
    )
    if r.interleavings is not None:
        line += f", {r.interleavings:.3g} interleavings"
    if r.counterexample is not None:
        line += "\ncounterexample:\n  " + "\n  ".join(r.counterexample)
    return line
