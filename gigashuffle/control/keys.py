"""Every Redis key name of a queue, built in one place.

All keys of one queue on one node share the hash tag ``{<queue>@<node>}``, so a Redis Cluster keeps them on one
shard and every Lua script may touch all of them. Nothing else in the package spells a key. A queue name may hold
``@`` but a node id may not (config/checks.py refuses it), so a tag splits at its last ``@`` one way only: no
two (queue, node) pairs share keys. Neither may hold braces or colons.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "gigashuffle"
META_PATTERN = f"{PREFIX}:{{*}}:meta"
# ``gen`` is set as the first trainer of a node joins, before the buffer (and ``meta``) exists.
GEN_PATTERN = f"{PREFIX}:{{*}}:gen"
CONF_PATTERN = f"{PREFIX}:{{*}}:conf"
# The set of tokens of the trainers using a server's embedded instance: the one key that belongs to no queue.
EMBEDDED_USERS = f"{PREFIX}:embedded:users"


@dataclass(frozen=True)
class QueueKeys:
    queue: str
    node: str

    @property
    def tag(self) -> str:
        return f"{PREFIX}:{{{self.queue}@{self.node}}}"

    def _key(self, name: str) -> str:
        return f"{self.tag}:{name}"

    @property
    def gen(self) -> str:
        """The node session's generation: a process holding another one is stale and is refused."""
        return self._key("gen")

    @property
    def conf(self) -> str:
        """JSON of the settings every rank of the node must agree on."""
        return self._key("conf")

    @property
    def meta(self) -> str:
        """Hash: the buffer's layout, size, first row and owner, with an HMAC over them."""
        return self._key("meta")

    @property
    def dummy(self) -> str:
        """Hash: the dummy batch's row (writer 0 of the node's first rank), signed apart from ``meta``."""
        return self._key("dummy")

    @property
    def procs(self) -> str:
        """Hash: process id -> JSON (role, rank, index, pid, host, attach socket)."""
        return self._key("procs")

    @property
    def counters(self) -> str:
        """Hash: rows ``written`` and ``read`` through the node's slot table, for rates in ``gigashuffle stats``,
        and its slot counts (``full``, ``empty``, ``in_flight``), as a trainer's heartbeat last recorded them."""
        return self._key("counters")

    def rank(self, global_rank: int) -> str:
        """A trainer's claim on its rank: a token with a TTL, refreshed by a heartbeat."""
        return self._key(f"rank:{global_rank}")

    def cut(self, generation: str) -> str:
        """Hash: local rank -> how far its trainer got in the node's checkpoint cuts of session ``generation``
        (NOTE [ Node cut ] in control/cutbarrier.py). Scoped by generation and given a TTL, so no earlier session's
        entry can count; the session's last trainer does not need to delete it."""
        return self._key(f"cut:{generation}")

    @property
    def rank_pattern(self) -> str:
        """A SCAN pattern matching every rank claim of this queue on this node."""
        return self._key("rank:*")

    def fixed(self) -> list[str]:
        """The keys every session has, whatever processes joined."""
        return [
            self.gen,
            self.conf,
            self.meta,
            self.procs,
            self.counters,
            self.dummy,
        ]

    @staticmethod
    def parse_tag(key: str) -> tuple[str, str] | None:
        """``(queue, node)`` from any key of a queue, or None for a key that is not ours."""
        start, end = key.find("{"), key.find("}")
        if not key.startswith(PREFIX + ":") or start < 0 or end < start:
            return None
        queue, _, node = key[start + 1 : end].rpartition("@")
        return (queue, node) if queue else None
