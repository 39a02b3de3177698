"""A reader's pause for a checkpoint's cut (NOTE [ Checkpoint cut ] in checkpoint/cut.py), over a real channel pair."""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace
from typing import Any, cast

import torch

from gigashuffle.procs import reader
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.messages import Pause, Paused, Resume
from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing

_WAIT_S = 10.0


def test_a_pause_read_together_with_the_last_cuts_resume_is_answered() -> None:
    """A reader slow to read its channel finds the Resume of one cut and the Pause of the next in one read: it must
    answer that Pause and stay paused, or the next cut waits for it until it times out."""
    trainer, child = Channel.pair()
    env = cast(Any, SimpleNamespace(channel=child))  # _pause talks to the trainer through its channel only
    trainer.send(Resume())
    trainer.send(Pause(2))
    ring = BatchRing(Layout.from_chunk([{"id": torch.arange(4, dtype=torch.int64)}]), bs=4, depth=2)
    paused = threading.Thread(target=reader._pause, args=(env, ring, deque(), 1), daemon=True)
    paused.start()
    for cut in (1, 2):  # each answer names the cut it answers: the trainer drops one of a cut that is over
        assert trainer.poll(_WAIT_S), f"no Paused for cut {cut}"
        assert trainer.recv()[0] == Paused(cut)
    assert paused.is_alive(), "the reader resumed although the second cut had paused it"
    trainer.send(Resume())
    paused.join(_WAIT_S)
    assert not paused.is_alive(), "the reader did not resume after the second cut's Resume"
    trainer.close()
    child.close()
    ring.close()
