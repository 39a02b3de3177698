"""A trainer's membership in its node's queue session: the rank claim, its heartbeat, and leaving.

NOTE [ Node sessions ]
Each trainer claims ``rank:<global_rank>`` with a token and a TTL that a heartbeat thread extends. The first
trainer of a node to claim while no other rank of the node holds a claim starts a new session: it wipes what
a dead earlier session left in Redis and sets a fresh random generation, which every child then quotes. A claim
held by a live trainer is refused (``QueueInUseError``); one whose holder is a dead process on this host is
dropped at once, so a restarted job does not wait for the TTL, and so are dead holders' claims of the node's other
ranks (else the first restarted rank would join the dead session). The last trainer to leave deletes every key.

A session is bound to the server's identity: the generation starts with the ``run_id`` of the server that
created it. JOIN starts a new session when the stored generation names another server (one restored from a
snapshot or a failed-over replica brings back an older session's keys, claims included), and the heartbeat
compares the server's ``run_id`` with the one seen at join, so a restart, a restore or a failover is noticed
even when every key came back.

NOTE [ Heartbeat ]
Every ``HEARTBEAT_S`` (2 s; the claim's lease is 10 s) a trainer sends one command, ``SET rank:<r> <token> XX GET
PX <lease>``, then records the node's counts with one HSET. The SET extends the claim only if it exists, and
returns what it held: nothing means Redis lost it (restarted empty, flushed, or the claim lapsed), and another
token means another trainer took the rank; that value is written back (RESTORE_CLAIM, unless it changed again)
and this trainer's session is lost. A retried SET finds its own token, so retries are harmless. Every
``VERIFY_EVERY``-th beat (10 s) also reads the generation and the server's ``run_id``: a server restored from a
snapshot or failed over to a replica may hold this very claim and still be another server, and a generation
key that is gone or replaced while the claim stayed means a new session. Together about 1.2 commands a second
per trainer, far under one per hundred batches even for 150 KB rows; the cost is that a
restored server holding every key is noticed within 10 s rather than 1 s. Nothing on the rows' path waits for it
(the slot table is in shared memory), so only the control plane's view is stale meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

from gigashuffle.config import DataloaderConfig
from gigashuffle.control import embedded
from gigashuffle.control.client import Client, connect, translate_errors
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.plane import ControlPlane, NodeCounts
from gigashuffle.errors import ConfigMismatchError, GigashuffleError, QueueInUseError, QueueStateLostError
from gigashuffle.host.pids import pid_alive

log = logging.getLogger(__name__)

LEASE_MS = 10_000
HEARTBEAT_S = 2.0
VERIFY_EVERY = 5  # heartbeats per check of the generation and the server's run_id (NOTE [ Heartbeat ])
_CLOSE_REDIS_BUDGET_S = 2.0  # leave_at_close's retry budget
_STOP_WAIT_S = 1.0  # how long stopping the heartbeat waits for a beat in progress (a few ms when Redis answers)
# checkpoint_rows: a node's cut by positions relies on every rank counting its own writers' rows
# (checkpoint/positions.py).
_SHARED_FIELDS = (
    "bs", "shuffle_size", "min_mixing", "fill_once", "evict_on_read", "local_world_size", "seed", "checkpoint_rows",
    "lock_stripes",
)  # fmt: skip


def shared_conf(config: DataloaderConfig) -> str:
    """The settings every rank of a node must agree on, as JSON."""
    return json.dumps({name: getattr(config, name) for name in _SHARED_FIELDS}, sort_keys=True)


def _in_use_advice(cfg: DataloaderConfig) -> str:
    """What to change when this rank's claim is taken: most often every rank of a job left its ranks at 0."""
    world = os.environ.get("WORLD_SIZE", "")
    if cfg.global_world_size == 1 and world.isdigit() and int(world) > 1:
        return (
            f"this process runs in a job of WORLD_SIZE={world} but its config has global_world_size=1, so every "
            "rank claims rank 0: build it with DataloaderConfig.from_env(...) (or set local_rank, global_rank, "
            "local_world_size and global_world_size)"
        )
    return (
        "each process of a job needs its own global_rank (set local_rank, global_rank, local_world_size and "
        "global_world_size, or use DataloaderConfig.from_env(...) under torchrun); otherwise give this loader "
        "another queue_name or stop that job"
    )


class NodeSession:
    """Joins the node's session on construction; ``leave()`` (idempotent) ends this trainer's part."""

    def __init__(self, client: Client, config: DataloaderConfig) -> None:
        self.config = config
        self.store = ControlPlane(client, QueueKeys(config.queue_name, config.node))
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        first = config.global_rank - config.local_rank
        self.other_ranks = [r for r in range(first, first + config.local_world_size) if r != config.global_rank]
        self.lost: Exception | None = None
        self.server_id = ""
        # What the heartbeat records for ``gigashuffle stats``; set by the supervisor once it maps the slot table.
        self.counts: Callable[[], NodeCounts | None] = lambda: None
        self._left = False
        self._join()
        self._start_heartbeat()

    @property
    def generation(self) -> str:
        return self.store.generation

    def _join(self) -> None:
        cfg = self.config
        self.server_id = self.store.server_id()
        # A dead trainer's claim on another rank of this node would make this one join the dead session (its
        # buffer's metadata names attach sockets of dead processes): drop those first, as this rank's own below.
        for rank in self.other_ranks:
            holder = self.store.claim_of(rank)
            if holder is not None and self._holder_is_dead(holder):
                log.info("dropping the claim of dead trainer %s of rank %d on %s", holder, rank, cfg.queue_name)
                self.store.drop_stale_claim(rank, holder)
        for _attempt in range(2):
            result = self.store.join(
                cfg.global_rank, self.other_ranks, self.token, LEASE_MS, shared_conf(cfg),
                f"{self.server_id}/{uuid.uuid4().hex}",
            )  # fmt: skip
            if not isinstance(result, str):
                break
            if not self._holder_is_dead(result):
                raise QueueInUseError(
                    f"queue_name={cfg.queue_name!r} global_rank={cfg.global_rank} on node {cfg.node!r} is held by "
                    f"another live trainer ({result}); {_in_use_advice(cfg)}"
                )
            log.info("dropping the claim of dead trainer %s on %s", result, cfg.queue_name)
            self.store.drop_stale_claim(cfg.global_rank, result)
        else:
            raise QueueInUseError(f"could not claim rank {cfg.global_rank} of {cfg.queue_name!r}: {result}")
        if result.conf != shared_conf(cfg):
            self.store.release_rank(cfg.global_rank, self.other_ranks, self.token)
            raise ConfigMismatchError(
                f"queue_name={cfg.queue_name!r} on node {cfg.node!r} already runs with {result.conf}, but this rank "
                f"was configured with {shared_conf(cfg)}; every rank of a node must use the same settings"
            )

    @staticmethod
    def _holder_is_dead(holder: str) -> bool:
        host, _, rest = holder.partition(":")
        pid_text = rest.partition(":")[0]
        return host == socket.gethostname() and pid_text.isdigit() and not pid_alive(int(pid_text))

    def _start_heartbeat(self) -> None:
        self._stop = stop = threading.Event()  # each thread its own: one left behind never beats for the next
        self._thread = threading.Thread(target=self._beat, args=(stop,), name="gigashuffle-heartbeat", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat; wait for a beat in progress at most ``_STOP_WAIT_S``. A beat's call to a Redis that
        does not answer retries for ``redis_timeout_s``: close() (on torchrun's SIGTERM, say, after the rank that
        ran the node's embedded server died) must not wait for that. The thread, a daemon, then ends by itself
        and its findings are dropped."""
        self._stop.set()
        self._thread.join(_STOP_WAIT_S)
        if self._thread.is_alive():
            log.debug("the heartbeat of %s is inside a Redis call; not waiting for it", self.config.queue_name)

    def rejoin(self) -> None:
        """Join again after the session was lost (a Redis restart): a new generation if no rank holds one."""
        self.stop_heartbeat()
        self.lost = None
        self._join()
        self._start_heartbeat()

    def _beat(self, stop: threading.Event) -> None:
        beats = 0
        while not stop.wait(HEARTBEAT_S):
            beats += 1
            try:
                lost: Exception | None = self._lost_at_beat(beats % VERIFY_EVERY == 0)
            except GigashuffleError as exc:
                lost = exc
            if stop.is_set():  # stopped during the beat: the session moved on (left or rejoined) without it
                if self._left:  # close() closed the client while this beat's call held (or reopened) a connection
                    self.store.client.close()
                return
            if lost is not None:
                self.lost = lost
                return

    def _lost_at_beat(self, verify: bool) -> QueueStateLostError | None:
        """One heartbeat (NOTE [ Heartbeat ]): why the session is lost, or None."""
        store, rank = self.store, self.config.global_rank
        held = store.extend_claim(rank, self.token, LEASE_MS)
        if held is None:
            return QueueStateLostError(f"the queue's session in Redis is gone (the claim of rank {rank} is)")
        if held != self.token:
            store.restore_claim(rank, self.token, held, LEASE_MS)
            return QueueStateLostError(f"another trainer took rank {rank} of the queue's session ({held})")
        counts = self.counts()
        if counts is not None:
            store.record_counts(counts)
        if not verify:
            return None
        generation = store.generation_now()
        if generation != self.generation:
            return QueueStateLostError(f"the node session is gone or replaced (generation {generation})")
        server_id = store.server_id()
        if server_id != self.server_id:
            return QueueStateLostError(
                f"Redis is another server now (run_id {self.server_id} -> {server_id}): it was restarted, "
                "restored from a snapshot or failed over, so its view of the queue cannot be trusted"
            )
        return None

    def abandon(self) -> None:
        """Stop the heartbeat without touching Redis (it is gone); the claim expires with its TTL."""
        self._left = True
        self.stop_heartbeat()

    def leave(self, store: ControlPlane | None = None) -> bool:
        """Stop the heartbeat and drop the claim (through ``store``, default this session's own); True if this was
        the node's last trainer, which deletes every key of the session."""
        if self._left:
            return False
        self._left = True
        self.stop_heartbeat()
        return (store or self.store).release_rank(self.config.global_rank, self.other_ranks, self.token)


def leave_at_close(session: NodeSession, redis_url: str, server: embedded.EmbeddedServer | None) -> None:
    """Leave ``session`` as the loader closes, through a client of its own with a short retry budget: close()
    must not wait out redis_timeout_s on a dead server. A Redis that does not answer is abandoned (the claim
    expires with its TTL, and the next session of the queue cleans up)."""
    store = _closing_store(session, redis_url, server)
    if store is None:
        session.abandon()
        return
    try:
        session.leave(store)
    except GigashuffleError as exc:
        log.warning("could not leave the queue session cleanly: %s", exc)
    finally:
        store.client.close()


def _closing_store(session: NodeSession, redis_url: str, server: embedded.EmbeddedServer | None) -> ControlPlane | None:
    if server is not None and not embedded.answers(server.socket_path):
        log.warning("the embedded Redis of %s is gone (its starter died); nothing to clean in it", session.config.node)
        return None
    client = None
    try:
        client = connect(redis_url, _CLOSE_REDIS_BUDGET_S)
        with translate_errors(redis_url):
            client.ping()
    except GigashuffleError as exc:
        log.warning("Redis does not answer at close (%s); the next session of this queue cleans up", exc)
        if client is not None:
            client.close()
        return None
    return ControlPlane(client, session.store.keys, session.store.generation)
