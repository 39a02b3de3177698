"""Ring slots on their way between a reader and the trainer, through the ring (NOTE [ A ring slot's walk ] in
trainer/inbox.py, NOTE [ Slot queues ] in shm/slotqueue.py), without a loader.

The children are real ``ChildProcess`` records with real rings and channels; the reader's side is the ring read as
its loop reads it (``returns.take``, ``_take_frees``, ``_wait_for_slot``), in a second process where the ring's
sharing matters.
"""

from __future__ import annotations

import multiprocessing
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from gigashuffle.procs.channel import Channel
from gigashuffle.procs.messages import FreeSlot, Paused, Resume
from gigashuffle.procs.readerio import _take_frees, _wait_for_slot
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.shm.memfd import SharedMemory
from gigashuffle.shm.slotqueue import slots_per_wake
from gigashuffle.trainer.childmessages import drain
from gigashuffle.trainer.inbox import DroppedBatches, Inbox
from gigashuffle.trainer.pinning import Placement

LAYOUT = Layout.from_chunk([{"id": torch.arange(4, dtype=torch.int64)}])


def _reader(index: int, depth: int) -> tuple[ChildProcess, Channel]:
    ours, theirs = socket.socketpair()
    child = ChildProcess("reader", index, seq=index, channel=Channel(ours))
    child.ring = BatchRing(LAYOUT, bs=4, depth=depth)
    return child, Channel(theirs)


def _taken(ring: BatchRing) -> list[int]:
    return ring.returns.take()


def _drop(dropped: DroppedBatches, child: ChildProcess, *ks: int) -> None:
    for k in ks:
        child.held += 1  # the loader counts a batch as held when it delivers it
        dropped.release_later(child, k)()


def _doorbells(channel: Channel) -> int:
    rung = 0
    while channel.poll(0):
        message, _fds = channel.recv()
        assert isinstance(message, FreeSlot)
        rung += 1
    return rung


def test_slots_come_back_in_the_order_given_through_every_wrap_of_the_ring() -> None:
    child, _theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    rng = random.Random(7)
    with_reader, with_trainer, on_the_way = deque(range(4)), [], []  # each slot is in exactly one of them
    for _ in range(2000):  # hundreds of wraps of the return cells
        if with_reader and (not with_trainer or rng.random() < 0.5):
            with_trainer.append(with_reader.popleft())  # gathered and announced
        elif with_trainer:
            for k in rng.sample(with_trainer, rng.randint(1, len(with_trainer))):
                with_trainer.remove(k)
                assert not ring.returns.put((k,)), "the doorbell asked for by a reader that does not wait"
                on_the_way.append(k)
        if rng.random() < 0.6:  # the reader looks now, or after more returns
            assert _taken(ring) == on_the_way, "a return taken twice, out of order or not at all"
            with_reader.extend(on_the_way)
            on_the_way = []
    assert _taken(ring) == on_the_way
    assert _taken(ring) == []


def _reader_process(fd: int, nbytes: int, depth: int, expected: int, out: Any) -> None:
    ring = BatchRing(LAYOUT, bs=4, depth=depth, memory=SharedMemory(nbytes, fd))
    free: deque[int] = deque()
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < expected and time.monotonic() < deadline:
        free.extend(ring.returns.take())
        while free:
            k = free.popleft()
            seen.append(k)
            ring.seq[k] = 1  # "gathered again": the trainer's side may give it back
    out.send(seen)


def test_a_reader_in_another_process_takes_every_return_once_in_order() -> None:
    depth, rounds = 8, 20_000
    ring = BatchRing(LAYOUT, bs=4, depth=depth)
    fd = ring.memory.fd
    assert fd is not None
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=_reader_process, args=(fd, ring.nbytes, depth, rounds, theirs)
    )
    proc.start()
    given: list[int] = []
    deadline = time.monotonic() + 60
    k = 0
    ring.seq[:] = 1
    while len(given) < rounds and time.monotonic() < deadline:
        if ring.seq[k] == 1:  # the reader has gathered into it again (or it never left): give it back
            ring.seq[k] = 0
            ring.returns.put((k,))
            given.append(k)
        k = (k + 1) % depth
    assert ours.poll(60), "the reader process did not finish"
    seen = ours.recv()
    proc.join(timeout=30)
    ring.close()
    assert len(given) == rounds
    assert seen == given, "the reader took a return twice, out of order, or not at all"


def test_every_dropped_batch_is_given_back_at_once_and_held_falls() -> None:
    child, _theirs = _reader(0, depth=8)
    dropped = DroppedBatches()
    _drop(dropped, child, 5, 2, 7)
    assert list(dropped.due()) == [(child, 5), (child, 2), (child, 7)]
    assert child.held == 0, "the held count must fall when the drop is seen"
    assert list(dropped.due()) == [], "slots were given back twice"


def test_the_doorbell_rings_only_for_a_reader_that_waits() -> None:
    child, theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    inbox = Inbox(Placement(), [child])
    inbox.free(child, 1)
    assert _doorbells(theirs) == 0 and _taken(ring) == [1]
    ring.returns.wake_at(2)  # a reader with no free slot: wake it once two more came back
    inbox.free(child, 3)
    assert _doorbells(theirs) == 0, "a doorbell before the slots the reader asked for came"
    inbox.free(child, 0)
    assert _doorbells(theirs) == 1 and _taken(ring) == [3, 0]
    child.exitcode = -9  # killed
    inbox.free(child, 2)
    assert _doorbells(theirs) == 0 and _taken(ring) == [], "a dead reader's slot went back"


def test_a_reader_waiting_for_a_slot_asks_for_the_doorbell_and_wakes_on_it() -> None:
    child, theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    env = SimpleNamespace(channel=theirs)
    free: deque[int] = deque()
    others: list[Any] = []
    waiter = threading.Thread(target=lambda: others.extend(_wait_for_slot(env, ring, free, 30.0)))  # type: ignore[arg-type]
    waiter.start()
    deadline = time.monotonic() + 30
    while not ring.returns.waits[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ring.returns.waits[0] == slots_per_wake(4) == 2, "a reader about to wait did not ask for half its ring"
    inbox = Inbox(Placement(), [child])
    inbox.free(child, 2)
    inbox.free(child, 3)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    # Woken by the doorbell with both, or by its own look after RECHECK_S with the first: the second waits in the ring.
    assert list(free) + _taken(ring) == [2, 3] and others == [] and ring.returns.waits[0] == 0


def test_a_waiting_reader_returns_other_messages_and_stops_waiting_for_slots() -> None:
    child, theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    env = SimpleNamespace(channel=theirs)
    child.channel.send(Resume())
    free: deque[int] = deque()
    assert _wait_for_slot(env, ring, free, 30.0) == [Resume()]  # type: ignore[arg-type]
    assert list(free) == [] and ring.returns.waits[0] == 0


def test_drops_from_other_threads_are_all_seen() -> None:
    child, _theirs = _reader(0, depth=4)
    dropped = DroppedBatches()
    child.held = 400
    releases = [dropped.release_later(child, k % 4) for k in range(400)]

    def drop_all(part: list[Callable[[], None]]) -> None:
        for release in part:
            release()

    threads = [threading.Thread(target=drop_all, args=(part,)) for part in (releases[::2], releases[1::2])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    sent = [k for _child, k in dropped.due()]
    assert child.held == 0
    assert sorted(sent) == sorted(k % 4 for k in range(400))


def test_a_reader_with_free_slots_still_waits_for_its_messages() -> None:
    """A paused reader (or a fill_once reader between passes) with free ring slots waits on its channel, not in a
    busy loop: the slots it has are no reason to return early."""
    child, theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    env = SimpleNamespace(channel=theirs)
    free: deque[int] = deque([1])
    started = time.monotonic()
    assert _take_frees(env, ring, free, 0.3) == []  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.29, "returned at once with nothing to say"
    assert list(free) == [1] and ring.returns.waits[0] == 0
    ring.returns.put((3,))  # a slot given back meanwhile: taken, and still no early return
    started = time.monotonic()
    assert _take_frees(env, ring, free, 0.3) == []  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.29, "a slot given back ended a wait for messages"
    assert list(free) == [1, 3]


def test_a_reader_with_no_free_slot_does_not_wait_once_one_came_back() -> None:
    """The stream's reader asks for a slot while it has none: one given back before it looked means no wait."""
    child, theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    env = SimpleNamespace(channel=theirs)
    free: deque[int] = deque()
    ring.returns.put((2,))
    started = time.monotonic()
    assert _wait_for_slot(env, ring, free, 30.0) == []  # type: ignore[arg-type]
    assert time.monotonic() - started < 20, "waited for a slot it had been given"
    assert list(free) == [2] and ring.returns.waits[0] == 0


# -- the other way: batches announced to the trainer ------------------------------------------------------------


def test_a_message_is_applied_after_the_batches_announced_before_it() -> None:
    """A reader announces through its ring and then sends ``Paused`` (or ``PassEnd``): by the time the trainer
    applies the message, those batches are ready (a cut lists them; a pass does not end before them)."""
    child, theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    inbox = Inbox(Placement(), [child])
    ring.seq[[2, 0]] = [7, 8]  # their lane numbers (NOTE [ Lanes ])
    assert not ring.announcements.put([2, 0]), "a doorbell asked for by a trainer that does not wait"
    theirs.send(Paused(1))
    seen: list[tuple[object, list[int]]] = []
    drain(child, inbox, lambda c, message, fds: seen.append((message, [k for _c, k in inbox.waiting()])))
    assert seen == [(Paused(1), [2, 0])]
    assert ring.seq[2] == 0 and ring.seq[0] == 0, "the trainer has them: they carry no lane number any more"
    drain(child, inbox, lambda c, message, fds: seen.append((message, [])))
    assert inbox.ready == 2 and len(seen) == 1, "an announcement taken twice, or a message applied twice"


def test_the_pump_takes_every_readers_announcements_in_order() -> None:
    (first, _a), (second, _b) = _reader(0, depth=4), _reader(1, depth=4)
    assert first.ring is not None and second.ring is not None
    inbox = Inbox(Placement(), [first, second])
    first.ring.announcements.put([3, 1])
    second.ring.announcements.put([0])
    first.ring.announcements.put([2])
    assert inbox.expect_announcements() == (2, 4) and inbox.expect_announcements() == (2, 0)
    inbox.stop_expecting()
    assert [(c.index, k) for c, k in inbox.waiting()] == [(0, 3), (0, 1), (0, 2), (1, 0)]


def test_a_reader_rings_the_batch_doorbell_only_while_the_trainer_waits() -> None:
    (first, _a), (second, _b) = _reader(0, depth=4), _reader(1, depth=4)
    assert first.ring is not None and second.ring is not None
    writer = ChildProcess("writer", 0, seq=2, channel=first.channel)  # no ring: nothing to ask
    inbox = Inbox(Placement(), [first, writer, second])
    first.ring.announcements.put([3])  # before the trainer asked: no doorbell, taken when it asks
    assert inbox.expect_announcements() == (2, 1)
    assert first.ring.announcements.put([0]) and second.ring.announcements.put([1])
    inbox.stop_expecting()
    assert not first.ring.announcements.put([2]) and not second.ring.announcements.put([3])
    assert [k for _c, k in inbox.waiting()] == [3]


def test_taking_between_pumps_takes_every_readers_announcements_and_asks_no_doorbell() -> None:
    (first, _a), (second, _b) = _reader(0, depth=4), _reader(1, depth=4)
    assert first.ring is not None and second.ring is not None
    writer = ChildProcess("writer", 0, seq=2, channel=first.channel)  # no ring: nothing to take
    inbox = Inbox(Placement(), [first, writer, second])
    first.ring.announcements.put([3, 1])
    second.ring.announcements.put([0])
    assert inbox.take_announcements() == 3 and inbox.take_announcements() == 0
    assert [(c.index, k) for c, k in inbox.waiting()] == [(0, 3), (0, 1), (1, 0)]
    assert not first.ring.announcements.put([2]), "a trainer taking between pumps does not wait: no doorbell"


def test_has_puts_says_whether_a_take_would_find_one_through_every_wrap() -> None:
    child, _theirs = _reader(0, depth=3)
    queue = child.ring.announcements if child.ring is not None else None
    assert queue is not None and not queue.has_puts()
    for k in range(10):
        queue.put([k % 3])
        assert queue.has_puts() and queue.has_puts(), "looking took it"
        assert queue.take() == [k % 3] and not queue.has_puts()


def test_a_trainer_about_to_block_wakes_a_reader_waiting_for_slots_with_fewer_than_it_asked_for() -> None:
    child, theirs = _reader(0, depth=4)
    ring = child.ring
    assert ring is not None
    inbox = Inbox(Placement(), [child])
    ring.returns.wake_at(slots_per_wake(ring.depth))
    inbox.free(child, 1)
    assert _doorbells(theirs) == 0
    inbox.expect_announcements()
    inbox.stop_expecting()
    assert _doorbells(theirs) == 1, "the trainer blocked with a reader asleep on a slot it gave back"
    ring.returns.stop_waiting()
    inbox.expect_announcements()
    assert _doorbells(theirs) == 0, "a doorbell for a reader that does not wait"
