"""A ring slot's return cannot be cut by a signal (NOTE [ Reclaimed ring slots ] in shm/ring.py).

The death of a batch runs nothing of gigashuffle's; its slot goes back in ``buffer.reclaim()``, which the trainer
runs inside ``critical()`` sections (NOTE [ Ctrl-C ] in procs/interrupts.py). A tracer calls SIGINT's handler, as a
signal does, at every bytecode of the return path in turn (the section's entry and exit with their handler swaps,
the flush, the drain of dropped batches, the reclaim, the slots' return through the ring, the release queue of
pinned rings and its events), with the script's own handler installed after everything was built (raising
``KeyboardInterrupt``, as "save on Ctrl-C" scripts do). Whatever step it cuts, every dropped batch's slot goes back
to its reader exactly once and no batch still held goes back.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import pytest
import torch
from fakecuda import FakeCuda

from gigashuffle.procs import interrupts
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import Layout
from gigashuffle.shm import buffer
from gigashuffle.shm.buffer import BatchRing
from gigashuffle.shm.slotqueue import SlotQueue
from gigashuffle.trainer.inbox import DroppedBatches, Inbox
from gigashuffle.trainer.pinning import CudaPlacement, Placement
from gigashuffle.trainer.releases import ReleaseQueue, Ticket

DEPTH = 4
# The return path: what a signal may cut, from the section's entry (the handler swap) to the slot's return
# and the section's exit (the swap back and the delivery of a deferred interrupt).
TRACED: set[CodeType] = {
    interrupts.critical.__enter__.__code__,
    interrupts.critical.__exit__.__code__,
    interrupts._outermost_entered.__code__,
    interrupts._outermost_left.__code__,
    Inbox.flush.__code__,
    Inbox.free.__code__,
    DroppedBatches.due.__code__,
    buffer.reclaim.__code__,
    Channel.send.__code__,
    Channel.send_bytes.__code__,
    SlotQueue.put.__code__,
    ReleaseQueue.poll.__code__,
    ReleaseQueue._poll.__code__,
    ReleaseQueue._collect.__code__,
    Ticket.dropped.__code__,
    CudaPlacement.poll.__code__,
    CudaPlacement._pin_only_event.__code__,
    CudaPlacement._contexts.__code__,
}


def _script_handler(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@pytest.fixture(autouse=True)
def scripts_own_handler() -> Iterator[None]:
    before = signal.signal(signal.SIGINT, _script_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class Injector:
    """Calls SIGINT's handler (whichever is installed then) at the ``n``-th bytecode run in a ``TRACED`` function,
    with that frame, as a signal handled there would: what it raises is raised there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.fired_in: str | None = None

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code in TRACED:
            # Both, for every version: 3.13 sends no opcode events to a frame whose f_trace is not set yet, 3.12 none
            # unless a frame below asked for them too (_run_interrupted's).
            frame.f_trace_opcodes = True
            frame.f_trace = self.local
            return self.local
        return None

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and self.fired_in is None:
            if self.seen == self.n:
                self.fired_in = f"{frame.f_code.co_name} at offset {frame.f_lasti}"
                handler = signal.getsignal(signal.SIGINT)
                assert callable(handler)
                handler(signal.SIGINT, frame)
            self.seen += 1
        return self.local


def _run_interrupted(n: int, step: Callable[[], object]) -> tuple[str | None, bool]:
    injector = Injector(n)
    interrupted = False
    here = sys._getframe()
    here.f_trace_opcodes = True  # Python 3.12 turns opcode events on only then (see Injector.trace)
    sys.settrace(injector.trace)
    try:
        step()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(None)
        here.f_trace_opcodes = False
    return injector.fired_in, interrupted


def _reader() -> tuple[ChildProcess, Channel]:
    ours, theirs = socket.socketpair()
    child = ChildProcess("reader", 0, seq=0, channel=Channel(ours))
    child.ring = BatchRing(Layout.from_chunk([{"id": torch.arange(4, dtype=torch.int64)}]), bs=4, depth=DEPTH)
    return child, Channel(theirs)


def _freed(reader: ChildProcess) -> list[int]:
    """The ring slots given back so far, as the reader's loop takes them (NOTE [ Slot queues ])."""
    assert reader.ring is not None
    return reader.ring.returns.take()


def _close(reader: ChildProcess, theirs: Channel) -> None:
    if reader.ring is not None:
        reader.ring.close()
    reader.channel.sock.close()
    theirs.sock.close()


def _every_bytecode(round_trip: Callable[[int], tuple[str | None, list[int], list[int]]], least: int = 40) -> None:
    fired = 0
    for n in range(100_000):
        fired_in, freed, expected = round_trip(n)
        assert sorted(freed) == expected, f"signal at bytecode {n} ({fired_in}): slots back {freed}, not {expected}"
        assert buffer.handed_out() == 0, f"signal at bytecode {n} ({fired_in}): a hand-out was never reclaimed"
        assert not interrupts.in_section()
        if fired_in is None:
            break  # past the end of the path
        fired += 1
    assert fired >= least, f"only {fired} bytecodes traced: the tracer misses the return path"


def test_a_signal_at_every_bytecode_of_the_flush_returns_each_slot_once() -> None:
    def round_trip(n: int) -> tuple[str | None, list[int], list[int]]:
        reader, theirs = _reader()
        inbox = Inbox(Placement(), [reader])
        batches = []
        for k in range(DEPTH - 1):
            reader.held += 1  # as hand_over counts it
            batches.append(reader.ring.batch(k, inbox._dropped.release_later(reader, k)) if reader.ring else None)
        del batches[:2]  # slots 0 and 1 dropped; 2 still held
        fired_in, _interrupted = _run_interrupted(n, inbox.flush)
        with contextlib.suppress(KeyboardInterrupt):  # a deferred interrupt comes out at the end, after the work
            inbox.flush()
        freed = _freed(reader)
        assert 2 not in freed, f"signal at bytecode {n} ({fired_in}): a held batch's slot went back"
        assert reader.held == 1
        batches.clear()
        inbox.flush()
        freed += _freed(reader)
        _close(reader, theirs)
        return fired_in, freed, [0, 1, 2]

    _every_bytecode(round_trip, least=300)  # 516 when written, 371 once slots went back through the ring


def test_a_signal_at_every_bytecode_of_the_pinned_return_path_returns_each_slot_once() -> None:
    """Pinned rings (pin_memory alone), end to end as ``next()`` runs it: batches handed over by the inbox with
    tickets, dropped, then the poll of the release queue (an event recorded on the current stream) and the flush."""

    def round_trip(n: int) -> tuple[str | None, list[int], list[int]]:
        reader, theirs = _reader()
        assert reader.ring is not None
        cuda = FakeCuda(devices=1)
        place = CudaPlacement(cuda, 0, moves=False)
        place.adopt(reader.ring)
        inbox = Inbox(place, [reader])
        batches = [inbox.hand_over(reader, k) for k in range(DEPTH - 1)]
        del batches[:2]

        def step() -> None:
            place.poll()
            inbox.flush()

        fired_in, _interrupted = _run_interrupted(n, step)
        with contextlib.suppress(KeyboardInterrupt):
            step()
        freed = _freed(reader)
        assert 2 not in freed, f"signal at bytecode {n} ({fired_in}): a held batch's slot went back"
        assert reader.held == 1 and place.pending == 0
        batches.clear()
        step()
        freed += _freed(reader)
        place.close()
        _close(reader, theirs)
        return fired_in, freed, [0, 1, 2]

    _every_bytecode(round_trip, least=700)  # 918 when written


def test_a_signal_at_every_bytecode_of_the_release_queue_returns_each_slot_once() -> None:
    """Pinned rings: a dropped batch's ticket goes through ``ReleaseQueue`` (its event done at once here)."""

    def round_trip(n: int) -> tuple[str | None, list[int], list[int]]:
        reader, _theirs = _reader()
        released: list[int] = []
        queue = ReleaseQueue(lambda: None)
        assert reader.ring is not None
        batches = [reader.ring.batch(k, queue.ticket(lambda k=k: released.append(k)).dropped) for k in range(3)]
        del batches[:2]
        fired_in, _interrupted = _run_interrupted(n, queue.poll)
        with contextlib.suppress(KeyboardInterrupt):
            queue.poll()
        assert 2 not in released
        batches.clear()
        queue.poll()
        _close(reader, _theirs)
        return fired_in, released, [0, 1, 2]

    _every_bytecode(round_trip, least=300)  # 368 when written


def test_the_slot_return_runs_only_inside_a_section() -> None:
    """Where the release of a dropped batch runs: never where its views die, always in a section."""
    reader, theirs = _reader()
    inbox = Inbox(Placement(), [reader])
    where: list[bool] = []
    release = inbox._dropped.release_later(reader, 0)

    def noted() -> None:
        where.append(interrupts.in_section())
        release()

    assert reader.ring is not None
    reader.held += 1
    batch = reader.ring.batch(0, noted)
    del batch
    assert where == [], "the release ran where the batch died"
    inbox.flush()
    assert where == [True] and _freed(reader) == [0]
    _close(reader, theirs)
