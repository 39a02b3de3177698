"""What a rejoin does to each child (NOTE [ Rejoining ] in trainer/rejoin.py): the decision per child, with real
channels. The whole path (a Redis restart under a live loader) is in tests/chaos/test_redis_faults.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gigashuffle.procs.channel import Channel
from gigashuffle.procs.messages import Rejoin, Role
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.trainer.rejoin import resume_children

OLD, NEW = "server/old", "server/new"


class KillLog:
    """Stands in for the zygote's Kill requests: resume_children only asks it to kill by spawn number."""

    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill(self, seq: int) -> None:
        self.killed.append(seq)


@pytest.fixture
def channels() -> Iterator[list[Channel]]:
    made: list[Channel] = []
    yield made
    for channel in made:
        channel.close()


def child(channels: list[Channel], seq: int, generation: str, **state: object) -> tuple[ChildProcess, Channel]:
    ours, theirs = Channel.pair()
    channels.extend((ours, theirs))
    made = ChildProcess("writer", seq, seq, ours, generation=generation)
    for name, value in state.items():
        setattr(made, name, value)
    return made, theirs


def test_each_child_gets_what_its_state_calls_for(channels: list[Channel]) -> None:
    attached, attached_end = child(channels, 0, OLD, attached=True)
    starting, _ = child(channels, 1, OLD)
    # Spawned while the trainer learned the pids inside the rejoin (a death under the old session it handled
    # then): it quotes the new session already, so killing it would only make its death look like another
    # session change, and a second rejoin would wipe what the first one published (seen in CI: a reader waited
    # 30 s for a buffer no registered process served).
    fresh, _ = child(channels, 2, NEW)
    died_before, _ = child(channels, 3, OLD, superseded=True, exitcode=1)
    children = [attached, starting, fresh, died_before]
    spawned: list[tuple[Role, int, int]] = []

    def spawn(role: Role, index: int, restarts: int) -> ChildProcess:
        spawned.append((role, index, restarts))
        return ChildProcess(role, index, 10 + index, channels[0], generation=NEW)

    zygote = KillLog()
    resume_children(children, NEW, zygote, spawn)  # type: ignore[arg-type]

    message, _fds = attached_end.recv()
    assert message == Rejoin(NEW) and attached.generation == NEW
    assert zygote.killed == [1], "only the child still starting under the old session is killed"
    assert starting.superseded and not fresh.superseded
    assert spawned == [("writer", 3, 0)] and not died_before.superseded
    assert len(children) == 5
