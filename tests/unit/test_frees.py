"""Dropped batches on their way back to their readers (NOTE [ Batched frees ] in trainer/inbox.py), without a loader.

The children are real ``ChildProcess`` records with real rings and channels; what is checked is which ring slots
are due to go back when, and that the count of held batches falls as soon as the trainer sees a drop.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import torch

from gigashuffle.procs.channel import Channel
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.trainer.inbox import DroppedBatches, frees_per_message


def _reader(index: int, depth: int) -> ChildProcess:
    ours, _theirs = socket.socketpair()
    child = ChildProcess("reader", index, seq=index, channel=Channel(ours))
    child.ring = BatchRing(Layout.from_chunk([{"id": torch.arange(4, dtype=torch.int64)}]), bs=4, depth=depth)
    return child


def _drop(dropped: DroppedBatches, child: ChildProcess, *ks: int) -> None:
    for k in ks:
        child.held += 1  # the loader counts a batch as held when it delivers it
        dropped.release_later(child, k)()


def test_half_a_ring_goes_back_in_one_message_while_batches_are_ready() -> None:
    reader = _reader(0, depth=8)
    dropped = DroppedBatches()
    assert frees_per_message(8) == 4
    _drop(dropped, reader, 5, 2, 7)
    assert list(dropped.due(everything=False)) == []
    assert reader.held == 0, "the held count must fall when the drop is seen, not when the slots are sent"
    _drop(dropped, reader, 0)
    assert list(dropped.due(everything=False)) == [(reader, [5, 2, 7, 0])]
    assert list(dropped.due(everything=False)) == [], "slots were sent twice"


def test_everything_goes_back_before_the_trainer_waits() -> None:
    small, large = _reader(0, depth=2), _reader(1, depth=8)
    dropped = DroppedBatches()
    _drop(dropped, large, 3)
    _drop(dropped, small, 1)
    assert list(dropped.due(everything=False)) == [(small, [1])], "a 2-deep ring gets every slot back at once"
    _drop(dropped, large, 6)
    assert list(dropped.due(everything=True)) == [(large, [3, 6])]
    assert list(dropped.due(everything=True)) == []


def test_each_reader_gets_its_own_slots() -> None:
    first, second = _reader(0, depth=4), _reader(1, depth=4)
    dropped = DroppedBatches()
    _drop(dropped, first, 0)
    _drop(dropped, second, 0)
    _drop(dropped, second, 3)
    _drop(dropped, first, 2)
    assert sorted(dropped.due(everything=False), key=lambda due: due[0].index) == [(first, [0, 2]), (second, [0, 3])]


def test_drops_from_other_threads_are_all_seen() -> None:
    reader = _reader(0, depth=4)
    dropped = DroppedBatches()
    reader.held = 400
    releases = [dropped.release_later(reader, k % 4) for k in range(400)]

    def drop_all(part: list[Callable[[], None]]) -> None:
        for release in part:
            release()

    threads = [threading.Thread(target=drop_all, args=(part,)) for part in (releases[::2], releases[1::2])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    sent = [k for _child, ks in dropped.due(everything=True) for k in ks]
    assert reader.held == 0
    assert sorted(sent) == sorted(k % 4 for k in range(400))


def test_a_reader_without_a_ring_gets_its_slots_at_once_and_clear_forgets_the_rest() -> None:
    gone, alive = _reader(0, depth=8), _reader(1, depth=8)
    dropped = DroppedBatches()
    _drop(dropped, gone, 1)
    _drop(dropped, alive, 4)
    gone.ring = None  # the supervisor closes a dead reader's ring; nothing waits for a threshold it cannot reach
    assert list(dropped.due(everything=False)) == [(gone, [1])]
    dropped.clear()
    assert alive.unsent == []
    assert list(dropped.due(everything=True)) == []
