"""The exception tree of gigashuffle.

User input errors are plain ``ValueError``/``TypeError`` (raised by the constructor that got the input).
Everything that goes wrong at run time derives from :class:`GigashuffleError` and carries the context a user
needs to act on it without reading our source: which process, which queue, which field.
"""

from __future__ import annotations

import signal


class GigashuffleError(RuntimeError):
    """Base class of every run-time error raised by gigashuffle."""


class SchemaError(GigashuffleError, ValueError):
    """A dataset chunk does not match the layout taken from the first chunk (or cannot be stored at all)."""


class WorkerDied(GigashuffleError):
    """A writer or reader process ended while the loader needed it.

    A ``RuntimeError`` (through :class:`GigashuffleError`) whose message says "child ... died", as the reference
    loader's tests expect of a dead child, and then who died and how.

    ``traceback_text`` is the child's own formatted traceback when it died from an exception (children report
    it before exiting); it is empty when the child was killed by a signal.
    """

    def __init__(
        self,
        role: str,
        index: int,
        pid: int,
        exitcode: int | None,
        traceback_text: str = "",
        queue: str = "",
    ) -> None:
        self.role = role
        self.index = index
        self.pid = pid
        self.exitcode = exitcode
        self.traceback_text = traceback_text
        self.queue = queue
        super().__init__(self._describe())

    @property
    def signal(self) -> int | None:
        """The signal number that ended the child, if a signal did."""
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None

    def _describe(self) -> str:
        if self.signal is not None:
            try:
                how = f"killed by {signal.Signals(self.signal).name}"
            except ValueError:
                how = f"killed by signal {self.signal}"
        else:
            how = f"exited with code {self.exitcode}"
        text = f"gigashuffle {self.role} {self.index} (child pid {self.pid}) of queue {self.queue!r} died: {how}"
        if self.traceback_text:
            last = self.traceback_text.strip().splitlines()[-1]
            text += f": {last}\n\nTraceback from the {self.role} process:\n{self.traceback_text.rstrip()}"
        return text

    def __reduce__(self) -> tuple[type[WorkerDied], tuple[str, int, int, int | None, str, str]]:
        return (type(self), (self.role, self.index, self.pid, self.exitcode, self.traceback_text, self.queue))


class QueueInUseError(GigashuffleError):
    """Another live trainer already holds this queue name and global rank."""


class RedisUnavailableError(GigashuffleError):
    """Redis could not be reached within the retry budget, or is too old to use."""


class QueueStateLostError(GigashuffleError):
    """The node session could not be kept: Redis stayed unreachable past ``redis_timeout_s`` after it lost or
    replaced the queue's state (a restart, a FLUSHALL, a restore; those alone are survived by rejoining)."""


class TamperedMetadataError(GigashuffleError):
    """Metadata read from Redis failed its HMAC check: it was not written by a process of this node and user."""


class AttachError(GigashuffleError):
    """A process could not attach to the node's shared buffer."""


class NodeLockBusy(GigashuffleError):
    """The node's slot-table lock stayed held past a call's patience: its holder is stopped or stuck (a process
    that dies releases it). ``holder`` names the process, when it could be found."""

    def __init__(self, waited_s: float, holder: str) -> None:
        self.waited_s = waited_s
        self.holder = holder
        super().__init__(
            f"the node's slot-table lock has been held for more than {waited_s:g} s by {holder}; every writer and "
            "reader of the node waits for it"
        )

    def __reduce__(self) -> tuple[type[NodeLockBusy], tuple[float, str]]:
        return (type(self), (self.waited_s, self.holder))


class ConfigMismatchError(GigashuffleError, ValueError):
    """Two loaders on one queue and node disagree on a setting that must be shared (bs, shuffle_size, ...)."""


class CheckpointError(GigashuffleError, ValueError):
    """A checkpoint cannot be taken or loaded: a dataset without ``state_dict``/``load_state_dict``, a checkpoint
    of another rank layout, or writers that did not answer in time. The message names what differs and the fix."""
