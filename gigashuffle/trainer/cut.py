"""A checkpoint's consistent cut: the datasets' states plus every row that was read from them and not delivered.

NOTE [ Checkpoint cut ]
``state_dict()`` must bring back, exactly once, every row its trainer has not been handed yet: rows full in the
buffer, in a reader's ring, waiting in the trainer, in a writer's chunk not yet copied. It saves the rows
themselves ("rows way"), so any stateful dataset works. The trainer:
  1. sends every writer ``StateRequest(pause=True)``: the writer publishes every row it copied, answers its
     dataset's state for exactly the rows not in the buffer (between chunks, ``state_dict()``; inside a chunk, the
     state before that chunk and ``skip`` = the rows of it already copied: NOTE [ Respawned writers ] in
     procs/resume.py), and writes nothing until ``Resume``. A writer still putting a checkpoint's rows back answers
     once they are all full. A writer that dies is asked again once started again (it starts held);
  2. sends every reader ``Pause``: it gathers what it had drawn, announces those batches, answers ``Paused`` and
     draws nothing until ``Resume``. The channel keeps order, so the trainer has every announced batch once it
     has the ``Paused``. Writers go first so that readers keep draining the buffer while writers finish;
  3. copies out the rows of every full slot (it maps the buffer for this, once) and of every announced batch not
     yet handed to the caller, one ``uint8 [n, row_bytes]`` tensor per field;
  4. sends ``Resume`` to all. Training goes on from the same buffer: the cut changes nothing it delivers.
On ``load_state_dict`` writer 0 puts the saved rows back into the new buffer (published, not counted as its
dataset's rows) before it reads its dataset on, and every writer reads on from its saved state and skip. So every
row not handed to the trainer before ``state_dict()`` comes back once, in a new random order, and none handed
before it comes back. Batches handed out before the call count as consumed, whether or not the step that took
them finished. Exact for one rank per node (``local_world_size == 1``) that evicts on read (the default): with
several ranks on a node the other ranks' readers and writers would not be paused while this rank copied the buffer, so
each rank saves only its writers' states (unpaused), and no undelivered row is saved
(up to ``shuffle_size`` rows are skipped by a resume, as without this cut).
Figures (pause, size, resume) in docs/benchmarks.md, from ``python -m gigashuffle.tools.bench.checkpoint``: at
``shuffle_size`` 262,144 tiny rows the pause is 11-51 ms and the state 4 MB; at 1M, 63-116 ms and 10-12 MB.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import CheckpointError
from gigashuffle.procs.messages import DatasetState, Go, Pause, Resume, StateRequest
from gigashuffle.trainer.supervisor import Supervisor

_requests = itertools.count(1)
_POLL_S = 0.02


def exact(config: DataloaderConfig) -> bool:
    """Whether this rank's checkpoints save the buffer's rows (NOTE [ Checkpoint cut ])."""
    return config.local_world_size == 1 and not config.fill_once and config.evict_on_read


def take(sup: Supervisor, config: DataloaderConfig, timeout_s: float) -> tuple[list[DatasetState], dict[str, Any]]:
    """Pause this rank's writers and readers, read their states and the undelivered rows, resume them."""
    started = time.monotonic()
    deadline = started + timeout_s
    pause = exact(config)
    sup.start_cut(pause)
    try:
        answers = _writer_states(sup, config, deadline, pause)
        rows: dict[str, Any] = {}
        if pause:
            _pause_readers(sup, config, deadline)
            rows = _saved_rows(sup, answers)
        return answers, rows
    finally:
        if pause:
            for child in [*sup.writers(), *sup.readers()]:
                try:
                    child.channel.send(Resume())
                except OSError:
                    continue  # dying: its successor starts unpaused
            if sup.go:
                sup.send_to_writers(Go())  # writers started during the cut started held
        sup.end_cut(started)


def _writer_states(sup: Supervisor, config: DataloaderConfig, deadline: float, pause: bool) -> list[DatasetState]:
    """Every writer's answer; a writer that dies before it answers is asked again once started again."""
    answers: dict[int, DatasetState] = {}
    asked: dict[int, tuple[int, int]] = {}  # writer index -> (the child's spawn seq, the request it got)
    while len(answers) < config.num_writers:
        for child in sup.writers():
            if child.index in answers or asked.get(child.index, (-1, 0))[0] == child.seq:
                continue
            request = next(_requests)
            try:
                child.channel.send(StateRequest(request, pause))
            except OSError:
                continue  # it is dying: the zygote reports its exit and the supervisor starts it again
            asked[child.index] = (child.seq, request)
        sup.pump(_POLL_S)
        for index, (_seq, request) in asked.items():
            answer = sup.state_of(index)
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


def _pause_readers(sup: Supervisor, config: DataloaderConfig, deadline: float) -> None:
    asked: set[int] = set()
    while True:
        readers = sup.readers()
        for child in readers:
            if child.seq not in asked:
                try:
                    child.channel.send(Pause())
                except OSError:
                    continue
                asked.add(child.seq)
        # A reader whose ring has not come yet holds no rows; it reads its Pause before its first draw.
        if all(sup.is_paused(c) for c in readers if c.ring is not None):
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"queue {config.queue_name!r} rank {config.global_rank}: readers did not pause for the checkpoint "
                "in time"
            )
        sup.pump(_POLL_S)


def _saved_rows(sup: Supervisor, answers: list[DatasetState]) -> dict[str, Any]:
    """The rows of every full slot of the buffer, of every batch announced and not handed out, and those of the
    last checkpoint that a writer had not yet put back."""
    table = sup.table()
    parts: list[list[np.ndarray[Any, Any]]] = []
    layout_json = ""
    for answer in answers:
        if answer.rows and len(answer.rows[0]):
            parts.append([np.asarray(f) for f in answer.rows])
            layout_json = answer.layout_json
    if table is not None:
        buffer = sup.node_table.rows()
        layout_json = buffer.layout.to_json()
        ids = table.full_ids()
        out = [np.empty((len(ids), spec.row_bytes), dtype=np.uint8) for spec in buffer.layout.fields]
        buffer.gather(ids, out)
        parts.append(out)
    for child, k in sup.inbox.waiting():
        if child.ring is None:
            raise AssertionError("a batch announced by a reader without a ring")
        fields, _index = child.ring.regions(k)
        parts.append([f.numpy().copy() for f in fields])
        layout_json = layout_json or child.ring.layout.to_json()
    if not parts:
        return {}
    fields = [torch.from_numpy(np.concatenate(columns)) for columns in zip(*parts, strict=True)]
    return {"layout": layout_json, "fields": fields}
