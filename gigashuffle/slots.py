"""The Redis side of the loader: one method per slot transition, each one round trip.

See NOTE [ Slot states ] in ``scripts.py`` for the state machine these methods drive.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import scripts
from .keys import QueueKeys
from .redisconn import Client, address, translate_errors

SlotIds = npt.NDArray[np.int32]
_NO_SLOTS: SlotIds = np.empty(0, dtype=np.int32)


def pack(slot_ids: npt.ArrayLike) -> bytes:
    return np.asarray(slot_ids, dtype="<i4").tobytes()


def text(value: bytes | str) -> str:
    """redis-py returns bytes from our clients; accept str too (a client made with decode_responses)."""
    return value.decode() if isinstance(value, bytes) else value


def unpack(reply: bytes) -> SlotIds:
    """Slot ids from a script's comma-separated reply (numpy parses it in C)."""
    if not reply:
        return _NO_SLOTS
    return np.fromstring(reply, dtype=np.int32, sep=",")  # text mode: not the deprecated binary one


@dataclass(frozen=True)
class ShuffleBufferStats:
    """Slot counts of a node's buffer: ``full + empty + in_flight == shuffle_size`` once it is allocated."""

    full: int
    empty: int
    in_flight: int


@dataclass(frozen=True)
class JoinResult:
    generation: str
    conf: str
    new_session: bool


class SlotStore:
    """Slot bookkeeping of one queue on one node, for one process and one session generation."""

    def __init__(self, client: Client, keys: QueueKeys, generation: str = "") -> None:
        self.client = client
        self.keys = keys
        self.generation = generation
        self._where = address(client)
        # Script objects load themselves again after a restart wiped the script cache (NOSCRIPT).
        self._seed = client.register_script(scripts.SEED)
        self._writer = client.register_script(scripts.WRITER_CYCLE)
        self._reader = client.register_script(scripts.READER_CYCLE)
        self._evict = client.register_script(scripts.EVICT)
        self._reclaim = client.register_script(scripts.RECLAIM)
        self._stats = client.register_script(scripts.STATS)
        self._join = client.register_script(scripts.JOIN)
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._release = client.register_script(scripts.RELEASE_RANK)
        self._drop_stale = client.register_script(scripts.DROP_STALE_CLAIM)

    def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        with translate_errors(self._where):
            return script(keys=keys, args=args)

    # -- writers ---------------------------------------------------------------------------------------------
    def seed(self, slots: int, meta: dict[str, bytes | str]) -> bool:
        """Publish the buffer's metadata and mark every slot empty; False if another process already did."""
        pairs: list[Any] = [x for item in meta.items() for x in item]
        k = self.keys
        owner = meta.get("owner", b"")
        return bool(self._run(self._seed, [k.gen, k.meta, k.empty], [self.generation, slots, owner, *pairs]))

    def writer_cycle(self, proc: str, written: SlotIds, want: int) -> SlotIds:
        k = self.keys
        first = int(written[0]) if len(written) else ""
        args = [self.generation, len(written), first, want]
        return unpack(self._run(self._writer, [k.gen, k.empty, k.full, k.lease(proc), k.counters], args))

    # -- readers ---------------------------------------------------------------------------------------------
    def reader_cycle(self, proc: str, done: SlotIds, want: int, min_full: int, evict_on_read: bool) -> SlotIds:
        k = self.keys
        reply = self._run(
            self._reader,
            [k.gen, k.empty, k.full, k.lease(proc), k.reading, k.evict_pending, k.counters],
            [self.generation, int(done[0]) if len(done) else "", want, min_full, "1" if evict_on_read else "0"],
        )
        return unpack(reply)

    def evict(self, slot_ids: npt.ArrayLike) -> int:
        k = self.keys
        keys = [k.gen, k.empty, k.full, k.reading, k.evict_pending]
        return int(self._run(self._evict, keys, [self.generation, pack(slot_ids)]))

    # -- supervision -----------------------------------------------------------------------------------------
    def reclaim(self, proc: str, role: str) -> int:
        k = self.keys
        keys = [k.gen, k.empty, k.full, k.lease(proc), k.reading, k.procs, k.evict_pending]
        return int(self._run(self._reclaim, keys, [self.generation, proc, role]))

    def register(self, proc: str, info: dict[str, Any]) -> None:
        with translate_errors(self._where):
            self.client.hset(self.keys.procs, proc, json.dumps(info))

    def processes(self) -> dict[str, dict[str, Any]]:
        with translate_errors(self._where):
            raw = self.client.hgetall(self.keys.procs)
        return {text(k): json.loads(v) for k, v in raw.items()}

    def stats(self) -> tuple[bytes | None, int, int, int]:
        k = self.keys
        gen, full, empty, procs = self._run(self._stats, [k.gen, k.full, k.empty, k.procs], [])
        return gen, int(full), int(empty), int(procs)

    def counters(self) -> tuple[int, int]:
        """Rows ``(written, read)`` this session."""
        with translate_errors(self._where):
            written, read = self.client.hmget(self.keys.counters, ["written", "read"])
        return int(written or 0), int(read or 0)

    def meta(self) -> dict[str, bytes]:
        with translate_errors(self._where):
            raw = self.client.hgetall(self.keys.meta)
        return {text(k): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}

    # -- trainers --------------------------------------------------------------------------------------------
    def _session_keys(self) -> list[str]:
        with translate_errors(self._where):
            procs = [text(p) for p in self.client.hkeys(self.keys.procs)]
        fixed = [key for key in self.keys.fixed() if key not in (self.keys.gen, self.keys.conf)]
        return fixed + [self.keys.lease(p) for p in procs]

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

    def heartbeat(self, rank: int, token: str, lease_ms: int) -> bool:
        k = self.keys
        return bool(self._run(self._heartbeat, [k.rank(rank), k.gen], [token, lease_ms, self.generation]))

    def release_rank(self, rank: int, other_ranks: list[int], token: str) -> bool:
        k = self.keys
        keys = [k.rank(rank), *(k.rank(r) for r in other_ranks), k.gen, k.conf, *self._session_keys()]
        return bool(self._run(self._release, keys, [token, len(other_ranks)]))

    def drop_stale_claim(self, rank: int, holder: str) -> bool:
        return bool(self._run(self._drop_stale, [self.keys.rank(rank)], [holder]))
