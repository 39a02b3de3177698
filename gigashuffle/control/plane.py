"""The control plane: every Redis call a loader makes, none of them per batch.

See NOTE [ Control plane ] in ``lua.py``: sessions, claims, metadata, the process registry and counters. The
slots themselves live in the slot table (``shm/slottable.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.typing import EncodableT, FieldT

from gigashuffle.control import lua
from gigashuffle.control.client import Client, address, run_script, translate_errors
from gigashuffle.control.keys import QueueKeys
from gigashuffle.errors import RedisUnavailableError


class NodeCounts(NamedTuple):
    """What a heartbeat records for ``gigashuffle stats`` (the field names are the counters hash's)."""

    written: int  # rows committed through the node's slot table, ever
    read: int  # rows drawn by readers, ever
    full: int
    empty: int
    in_flight: int
    lock_held_ns: int  # the node lock's total hold time, ever
    lock_at_ns: int  # CLOCK_MONOTONIC when these were read, so rates divide by the right interval


"""Rows written and read (totals) and the full, empty and in-flight slots of a node's slot table; then, optionally,
the node lock's total hold time and the ``CLOCK_MONOTONIC`` time of that reading, both in ns
(NOTE [ Node lock budget ] in shm/slottable.py; the clock is one per machine, so the readings of a node's ranks
compare)."""


def text(value: bytes | str) -> str:
    """redis-py returns bytes from our clients; accept str too (a client made with decode_responses)."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class QueueStats:
    """What Redis knows of a node's queue: its generation and the counts its trainers' heartbeats last recorded."""

    generation: bytes | None
    full: int
    empty: int
    in_flight: int
    processes: int


@dataclass(frozen=True)
class JoinResult:
    generation: str
    conf: str
    new_session: bool


# What a rate needs from a counts record: the rows, the lock's total hold time and the time of the reading.
_RATE_FIELDS = ("written", "read", "lock_held_ns", "lock_at_ns")

MIN_REDIS = (6, 2)  # SET ... XX GET, the heartbeat's one command (NOTE [ Heartbeat ] in control/session.py)


def check_server_version(info: dict[str, Any], where: str) -> None:
    """Raise RedisUnavailableError for a server older than ``MIN_REDIS`` (``info``: its INFO server section).
    Valkey reports the Redis version it is compatible with as ``redis_version``."""
    version = str(info.get("redis_version", ""))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if len(parts) == 2 and parts < MIN_REDIS:
        raise RedisUnavailableError(
            f"the Redis server at {where} is version {version}, and gigashuffle needs Redis "
            f"{'.'.join(map(str, MIN_REDIS))} or newer (or Valkey): point redis_url at a newer server, or leave it "
            "unset for the embedded one"
        )


class ControlPlane:
    """The Redis side of one queue on one node, for one process and one session generation."""

    def __init__(self, client: Client, keys: QueueKeys, generation: str = "") -> None:
        self.client = client
        self.keys = keys
        self.generation = generation
        self._where = address(client)
        # Script objects load themselves again after a restart wiped the script cache (NOSCRIPT; see run_script).
        self._publish_meta = client.register_script(lua.PUBLISH_META)
        self._publish_dummy = client.register_script(lua.PUBLISH_DUMMY)
        self._stats = client.register_script(lua.STATS)
        self._join = client.register_script(lua.JOIN)
        self._restore_claim = client.register_script(lua.RESTORE_CLAIM)
        self._release = client.register_script(lua.RELEASE_RANK)
        self._drop_stale = client.register_script(lua.DROP_STALE_CLAIM)
        self._last_counts: NodeCounts | tuple[int, ...] | None = (
            None  # the last full record_counts(), sent again as prev_*
        )

    def _run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        return run_script(script, keys, args, self._where)

    # -- the buffer and the processes ------------------------------------------------------------------------
    def publish_meta(self, meta: dict[str, bytes | str]) -> bool:
        """Publish the buffer's metadata; False if another process already did."""
        pairs: list[Any] = [x for item in meta.items() for x in item]
        owner = meta.get("owner", b"")
        return bool(self._run(self._publish_meta, [self.keys.gen, self.keys.meta], [self.generation, owner, *pairs]))

    def publish_dummy(self, generation: str, fields: dict[str, bytes | str]) -> int:
        """Publish the dummy row's fields (lua.PUBLISH_DUMMY): 1 published, 0 one stands, -1 session gone."""
        pairs: list[Any] = [x for item in fields.items() for x in item]
        return int(self._run(self._publish_dummy, [self.keys.gen, self.keys.dummy], [generation, *pairs]))

    def register(self, proc: str, info: dict[str, Any]) -> None:
        with translate_errors(self._where):
            self.client.hset(self.keys.procs, proc, json.dumps(info))

    def unregister(self, proc: str) -> None:
        """Forget a dead process, so nobody tries its attach socket and stats stop counting it."""
        with translate_errors(self._where):
            self.client.hdel(self.keys.procs, proc)

    def processes(self) -> dict[str, dict[str, Any]]:
        with translate_errors(self._where):
            raw = self.client.hgetall(self.keys.procs)
        return {text(k): json.loads(v) for k, v in raw.items()}

    def stats(self) -> QueueStats:
        k = self.keys
        gen, full, empty, in_flight, procs = self._run(self._stats, [k.gen, k.counters, k.procs], [])
        return QueueStats(gen, int(full), int(empty), int(in_flight), int(procs))

    def server_id(self) -> str:
        """The ``run_id`` of the server holding this queue's keys. A restarted, snapshot-restored or failed-over
        server has a new one, whatever data it came back with. Refuses a server too old for the heartbeat."""
        with translate_errors(self._where):
            if isinstance(self.client, RedisCluster):
                node = self.client.get_node_from_key(self.keys.gen)  # type: ignore[no-untyped-call]
                info = self.client.info("server", target_nodes=node)
            else:
                info = self.client.info("server")
        check_server_version(info, self._where)
        return str(info["run_id"])

    def generation_now(self) -> str | None:
        """The node session's generation as Redis has it now (None when there is none)."""
        with translate_errors(self._where):
            value = self.client.get(self.keys.gen)
        return None if value is None else text(value)

    def counters(self) -> tuple[int, int, int, int]:
        """Rows written and read this session, and the node lock's total hold time and the time of that reading
        (ns; 0 until a trainer of the node recorded them)."""
        fields = ["written", "read", "lock_held_ns", "lock_at_ns"]
        with translate_errors(self._where):
            written, read, held, at = self.client.hmget(self.keys.counters, fields)
        return int(written or 0), int(read or 0), int(held or 0), int(at or 0)

    def meta(self) -> dict[str, bytes]:
        with translate_errors(self._where):
            raw = self.client.hgetall(self.keys.meta)
        return {text(k): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}

    # -- trainers --------------------------------------------------------------------------------------------
    def _session_keys(self) -> list[str]:
        return [key for key in self.keys.fixed() if key not in (self.keys.gen, self.keys.conf)]

    def join(
        self, rank: int, other_ranks: list[int], token: str, lease_ms: int, conf: str, new_gen: str
    ) -> JoinResult | str:
        """Claim ``rank``; returns the session, or the holder's token when a live trainer holds the rank."""
        k = self.keys
        keys = [k.gen, k.conf, k.rank(rank), *(k.rank(r) for r in other_ranks), *self._session_keys()]
        reply = self._run(self._join, keys, [token, lease_ms, len(other_ranks), conf, new_gen])
        if reply[0] == b"busy":
            return str(reply[1].decode())
        self.generation = reply[1].decode()
        return JoinResult(self.generation, reply[2].decode(), bool(reply[3]))

    def extend_claim(self, rank: int, token: str, lease_ms: int) -> str | None:
        """Set ``rank``'s claim to ``token`` for ``lease_ms`` if it exists, in one command (``SET ... XX GET``);
        returns the value it held before (``token`` while the claim is ours; a retried call sees its own write),
        or None when it is gone and nothing was written."""
        with translate_errors(self._where):
            before = self.client.set(self.keys.rank(rank), token, px=lease_ms, xx=True, get=True)
        return None if before is None else text(cast("bytes | str", before))

    def restore_claim(self, rank: int, token: str, holder: str, lease_ms: int) -> bool:
        """Give ``rank``'s claim back to ``holder`` after ``extend_claim`` overwrote it, unless it changed since."""
        return bool(self._run(self._restore_claim, [self.keys.rank(rank)], [token, holder, lease_ms]))

    def counter_records(self) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
        """The last two records of ``(written, read, lock_held_ns, lock_at_ns)`` that one trainer made (the newest
        first; zeros where there is none yet): ``gigashuffle stats`` takes rates between them."""
        fields = [*_RATE_FIELDS, *(f"prev_{name}" for name in _RATE_FIELDS)]
        with translate_errors(self._where):
            values = [int(v or 0) for v in self.client.hmget(self.keys.counters, fields)]
        return (values[0], values[1], values[2], values[3]), (values[4], values[5], values[6], values[7])

    def record_counts(self, counts: NodeCounts | tuple[int, ...]) -> None:
        """Record the node's counts for ``gigashuffle stats``: absolute values, which every rank may write. A
        shorter tuple records its leading fields and leaves the others as they are. A full record (with the lock's
        reading and its time) also carries this process's previous full record as ``prev_*``, in the same
        command: a reader gets two records of one clock, made a heartbeat apart."""
        fields = NodeCounts._fields
        mapping: dict[FieldT, EncodableT] = dict(zip(fields, counts, strict=False))
        if len(counts) >= len(fields):
            last = self._last_counts
            if last is not None:
                mapping.update({f"prev_{name}": last[fields.index(name)] for name in _RATE_FIELDS})
            self._last_counts = counts
        with translate_errors(self._where):
            self.client.hset(self.keys.counters, mapping=mapping)

    def release_rank(self, rank: int, other_ranks: list[int], token: str) -> bool:
        k = self.keys
        keys = [k.rank(rank), *(k.rank(r) for r in other_ranks), k.gen, k.conf, *self._session_keys()]
        return bool(self._run(self._release, keys, [token, len(other_ranks)]))

    def claim_of(self, rank: int) -> str | None:
        """The token holding ``rank``'s claim, or None."""
        with translate_errors(self._where):
            value = self.client.get(self.keys.rank(rank))
        return None if value is None else text(value)

    def drop_stale_claim(self, rank: int, holder: str) -> bool:
        return bool(self._run(self._drop_stale, [self.keys.rank(rank)], [holder]))
