"""Ctrl-C at every line of the trainer's handovers (NOTE [ Ctrl-C ] in procs/interrupts.py), deterministically.

A tracer raises SIGINT in this (main) thread at the n-th line executed inside the loader's batch path: the handover
of a batch, the frees of dropped batches, a channel message read and applied, the reclaim of a dropped batch's
ring slot. For every n the step either completes or ends in ``KeyboardInterrupt``, and the test iterates on with a
new iterator, as a trainer that catches Ctrl-C does. Afterwards every ring slot of every reader must come back and the
loader must keep delivering: a slot lost at any one of those lines fails it.
"""

from __future__ import annotations

import collections
import signal
import sys
import time
import uuid
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from datasets import UniqueIds, check_unique_batch, take

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.interrupts import critical
from gigashuffle.shm import buffer
from gigashuffle.shm.slotqueue import SlotQueue
from gigashuffle.trainer.batches import Batches
from gigashuffle.trainer.childmessages import ChildMessages
from gigashuffle.trainer.inbox import DroppedBatches, Inbox
from gigashuffle.trainer.supervisor import Supervisor

BS, SHUFFLE = 8, 256
RINGS_BACK_S = 60.0  # a started loader's readers refill their rings within a few pumps; generous for a loaded box
TRACED: set[CodeType] = {
    Batches.next_batch.__code__,
    Batches.deliver.__code__,
    Inbox.flush.__code__,
    Inbox.give_back_dropped.__code__,
    Inbox.free.__code__,
    SlotQueue.put.__code__,
    SlotQueue.take.__code__,
    Inbox.take_announced.__code__,
    Supervisor._drain.__code__,
    ChildMessages.on_message.__code__,
    DroppedBatches.due.__code__,
    Channel.recv_bytes.__code__,
    Channel.send_bytes.__code__,
    buffer.reclaim.__code__,
}


class Injector:
    """SIGINT at the ``n``-th line run in a ``TRACED`` function (this thread only): the process's SIGINT handler is
    called with that function's frame, as when a signal is handled there, and what it raises is raised there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.fired = False

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code in TRACED:
            return self.local
        return None

    def local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and not self.fired:
            if self.seen == self.n:
                self.fired = True
                handler = signal.getsignal(signal.SIGINT)
                assert callable(handler)
                handler(signal.SIGINT, frame)
            self.seen += 1
        return self.local


def _ready_within(loader: MultiprocessShuffledDataloader, seconds: float) -> bool:
    sup = loader._sup
    deadline = time.monotonic() + seconds
    while not sup.inbox.ready and time.monotonic() < deadline:
        sup.pump(0.05)
    return bool(sup.inbox.ready)


def rings_whole(
    loader: MultiprocessShuffledDataloader,
    seconds: float = RINGS_BACK_S,
    readers: int | None = 2,
    tick: Callable[[], None] = lambda: None,
) -> tuple[bool, str]:
    """Whether every reader's ring comes back whole within ``seconds``: no slot held, every slot filled and ready
    (and ``readers`` readers with rings; None: any number, at least one). ``tick`` runs before each pump (a fake
    GPU's progress). Also what the detail of a failure shows."""
    sup = loader._sup
    deadline = time.monotonic() + seconds
    detail = ""
    while time.monotonic() < deadline:
        tick()
        sup.pump(0.05)
        live = sup.readers()
        ready = collections.Counter(id(c) for c, _k in sup.inbox.waiting())
        depths = {id(c): c.ring.depth for c in live if c.ring is not None}
        held = [c.held for c in live]
        detail = f"ready {sorted(ready.values())}, depths {sorted(depths.values())}, held {held}"
        counted = len(live) == readers if readers is not None else bool(live)
        if counted and len(depths) == len(live) and not any(held) and all(ready[k] == d for k, d in depths.items()):
            return True, detail
    return False, detail


def test_sigint_at_every_line_of_the_batch_path_loses_no_ring_slot(redis_url: str) -> None:
    cfg = DataloaderConfig(
        bs=BS, shuffle_size=SHUFFLE, queue_name=f"lines-{uuid.uuid4().hex[:8]}", num_writers=2, num_readers=2,
        ring_depth=2, redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        it = iter(loader)
        take(it, 1)  # started
        batch: Any = None
        fired = interrupted = 0
        for n in range(200):
            # next() would wait for ever once every ring slot is lost: wait for a ready batch with a deadline first.
            try:
                ready = _ready_within(loader, RINGS_BACK_S)
            except KeyboardInterrupt:  # deferred in the last step's release callback: raised at a section's end
                interrupted += 1
                it = iter(loader)
                ready = _ready_within(loader, RINGS_BACK_S)
            assert ready, f"no batch ready after {interrupted} interrupts: ring slots lost"
            injector = Injector(n)
            sys.settrace(injector.trace)
            try:
                batch = next(it)  # a view of the ring: nothing else held, so no copy
                del batch  # its release runs here, in the traced path; its frees go back in the next step
            except KeyboardInterrupt:
                interrupted += 1
                it = iter(loader)
            finally:
                sys.settrace(None)
                batch = None  # one the interrupt kept from the del above
            fired += injector.fired
        # A step fires only if its next() runs more traced lines than its number: 17-31 of 200 do since ring slots
        # go back through the ring (no send on the path); a tracer that misses the path fires none.
        assert fired >= 10, f"only {fired} of 200 steps reached their line: the tracer misses the batch path"
        try:  # one interrupt deferred in the last step's release callback is raised by the next section's end
            with critical():
                pass
        except KeyboardInterrupt:
            interrupted += 1
        whole, detail = rings_whole(loader)
        assert whole, f"ring slots lost after {interrupted} interrupts: {detail}"
        for batch in take(iter(loader), 50):
            check_unique_batch(batch, BS, SHUFFLE)
