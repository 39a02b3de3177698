"""``MultiprocessShuffledDataloader``: the object a training script iterates."""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.control import dummyrow, embedded
from gigashuffle.control.client import Client, connect
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.session import NodeSession
from gigashuffle.errors import GigashuffleError
from gigashuffle.host.pids import describe_process, is_stopped
from gigashuffle.host.rundir import remove_stale_sockets, runtime_dir
from gigashuffle.host.secret import node_secret
from gigashuffle.procs.messages import SetContext, SetEpoch, StartPass
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import INDEX_KEY, Layout
from gigashuffle.shm.slottable import LockUsage, ShuffleBufferStats
from gigashuffle.trainer import datasetstate, pinning, progress
from gigashuffle.trainer.metrics import LoaderMetrics, MetricsReader
from gigashuffle.trainer.supervisor import Supervisor

log = logging.getLogger(__name__)

Batch = list[dict[str, torch.Tensor]]
_SLOW_WARNING_S = 60.0
# How long stats() and evict() wait for the node lock before they raise NodeLockBusy (NOTE [ A stopped lock
# holder ] in shm/slottable.py): far longer than any transition holds it.
_LOCK_PATIENCE_S = 30.0
# How often the trainer looks at pending ring releases while it waits for a batch (NOTE [ Pinned rings ]).
_PENDING_PUMP_S = 0.002


def resolve_redis_url(config: DataloaderConfig) -> tuple[str, embedded.EmbeddedServer | None]:
    """The Redis to use: ``redis_url``, the seed's host/port/db, ``$GIGASHUFFLE_REDIS_URL``, else embedded."""
    url = config.redis_url or config.legacy_redis_url()
    if url:
        return url, None
    env_url = os.environ.get("GIGASHUFFLE_REDIS_URL")
    if env_url:
        if not env_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"GIGASHUFFLE_REDIS_URL={env_url!r} is invalid: use redis://host:port/db, rediss://... or "
                "unix:///path/to.sock, or unset it to use the embedded server"
            )
        return env_url, None
    server = embedded.acquire(config.node)
    return server.url, server


class MultiprocessShuffledDataloader:
    """Iterate over shuffled batches drawn from the node-wide shared buffer.

    Batches are zero-copy views into this rank's reader rings: a ring slot is reused only after every tensor of
    its batch (and every view of one) is gone, so a batch stays valid while the caller holds it. A caller that
    holds more batches than the ring has room for gets copies instead, never a stall. With
    ``DataloaderConfig.device="cuda:N"`` batches are on that device instead (NOTE [ Pinned rings ]).
    """

    def __init__(self, dataset: Any, config: DataloaderConfig) -> None:
        if not isinstance(config, DataloaderConfig):
            raise TypeError(f"config must be a DataloaderConfig, got {type(config).__name__}")
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"dataset must be an iterable (a torch IterableDataset) yielding chunks, got {type(dataset).__name__}"
            )
        self.config = config
        self.dataset = dataset
        # First, so that a machine without the GPU the config asks for fails before any process starts.
        self._placement = pinning.placement(config)
        self.keys = QueueKeys(config.queue_name, config.node)
        directory = runtime_dir()
        remove_stale_sockets(directory)
        self._secret = node_secret(directory)
        self._dummy: tuple[Layout, bytes] | None = None  # the verified dummy row, once read (it never changes)
        self.redis_url, server = resolve_redis_url(config)
        client: Client | None = None
        session: NodeSession | None = None
        try:
            client = connect(self.redis_url, config.redis_timeout_s)
            session = NodeSession(client, config)
            self._sup = Supervisor(config, dataset, client, self.redis_url, server, session, str(directory))
        except BaseException:
            if session is not None:
                session.leave()
            if client is not None:
                client.close()
            if server is not None:
                embedded.release(server)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._placement, self._sup)
        self._pass_open = False
        # The version of the write each slot held when this trainer last received it: evict() names that write,
        # so a late evict never drops a newer row (-1: never received here, evict whatever the slot holds).
        self._versions = np.full(config.shuffle_size, -1, dtype=np.int64)
        # Filling progress is shown while this rank waits for its first batch, then never again.
        self._progress: progress.FillProgress | None = None
        self._first_batch_seen = False
        self._metrics = MetricsReader(config.queue_name, config.global_rank, config.shuffle_size, config.bs)
        self.epoch: int | None = None  # the last set_epoch()

    # -- iteration -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per ``iter(loader)``: ``steps_per_epoch``, or a fill_once pass's length; else a TypeError, as
        for any iterable without a length (frameworks read that as an endless loader)."""
        cfg = self.config
        if cfg.fill_once:
            return cfg.shuffle_size // cfg.local_world_size // cfg.bs
        if cfg.steps_per_epoch is None:
            raise TypeError(
                "this loader streams without end, so it has no len(); set DataloaderConfig.steps_per_epoch=N to "
                "make each iter(loader) yield N batches and len(loader) return N"
            )
        return cfg.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        """Batches as ``list[dict]`` (one dict per group of the dataset's chunks), or a ``dict`` with
        ``DataloaderConfig.batch_format="dict"``; with ``steps_per_epoch``, that many per ``iter()``."""
        if self.config.num_readers == 0:
            raise GigashuffleError(
                f"queue {self.config.queue_name!r} rank {self.config.global_rank}: this loader has "
                "DataloaderConfig.num_readers=0, so it only feeds the node's buffer and yields no batches; iterate "
                "a loader with num_readers >= 1 (on this rank or another of the node). get_dummy_batch(), stats() "
                "and state_dict() work here."
            )
        if self.config.fill_once:
            return self._one_pass()
        return self._stream()

    def _stream(self) -> Iterator[Any]:
        steps = self.config.steps_per_epoch
        if steps is None:
            while True:
                yield self._next_batch()
        for _ in range(steps):
            yield self._next_batch()

    def _one_pass(self) -> Iterator[Any]:
        sup = self._sup
        self._finish_open_pass()
        reader = self._wait_for(lambda: sup.readers()[0] if sup.readers() else None, "the reader to start")
        sup.passes_ended.discard(0)
        reader.channel.send(StartPass(0))
        self._pass_open = True
        while True:
            while not sup.ready and 0 not in sup.passes_ended:
                self._show_filling()
                self._pump()
            self._filled()
            if sup.ready:
                yield self._deliver(*sup.ready.popleft())
            else:
                sup.passes_ended.discard(0)
                self._pass_open = False
                return

    def _finish_open_pass(self) -> None:
        """Discard the rest of a pass the caller abandoned, so the next pass starts at its first batch."""
        sup = self._sup
        while self._pass_open:
            while sup.ready:
                child, k = sup.ready.popleft()
                sup.send_free(child, k)
            if 0 in sup.passes_ended:
                sup.passes_ended.discard(0)
                self._pass_open = False
            else:
                sup.pump()

    def _next_batch(self) -> Any:
        sup = self._sup
        self._check_open()
        # Return the ring slots of dropped batches first: all of them when the trainer is about to wait, else those
        # of readers with half their ring to come back (NOTE [ Batched frees ]).
        sup.flush_frees(everything=not sup.ready)
        self._placement.poll()
        if not sup.ready:
            self._wait_for_batch()
        self._filled()
        return self._deliver(*sup.ready.popleft())

    def _wait_for_batch(self) -> None:
        """Pump until a batch is ready: the trainer's wait, timed for metrics() and named in profiler traces."""
        sup = self._sup
        waited_since = time.monotonic()
        next_warning = waited_since + _SLOW_WARNING_S
        try:
            with torch.profiler.record_function("gigashuffle.wait"):
                while not sup.ready:
                    self._show_filling()
                    self._pump()
                    if time.monotonic() > next_warning:
                        # Slow data is legitimate (a dataset on a slow filesystem), so this is a warning, not an error.
                        log.warning(
                            "queue %r: no batch for %.0f s; buffer %s (readers wait for %d full slots)%s",
                            self.config.queue_name, time.monotonic() - waited_since, _counts(sup),
                            self.config.min_full_slots, _stopped_lock_holder(sup),
                        )  # fmt: skip
                        next_warning += _SLOW_WARNING_S
        finally:
            self._metrics.wait_s += time.monotonic() - waited_since

    def _show_filling(self) -> None:
        if self._first_batch_seen:
            return
        if self._progress is None:
            cfg = self.config
            self._progress = progress.FillProgress(
                f"queue {cfg.queue_name!r} rank {cfg.global_rank}",
                cfg.min_full_slots,
                functools.partial(_full_slots, self._sup),  # not a method of self: no cycle keeps a loader alive
                bar=cfg.local_rank == 0,  # one bar per node: the ranks of a node share the terminal and the buffer
            )
        self._progress.update()

    def _filled(self) -> None:
        if self._first_batch_seen:
            return
        self._first_batch_seen = True
        if self._progress is not None:
            self._progress.finish()
            self._progress = None

    def _pump(self) -> None:
        """Wait a little for messages; with pinned rings, also release the ring slots whose copies are done."""
        placement = self._placement
        if not placement.tracks:
            self._sup.pump()
            return
        readers = [c for c in self._sup.readers() if c.ring is not None]
        # Block on a copy only when no reader has a free ring slot left: otherwise the GPU work queued before it
        # would stall the trainer for nothing.
        starved = bool(readers) and all(c.ring is not None and c.held >= c.ring.depth for c in readers)
        placement.poll(wait=starved)
        if placement.pending:
            self._sup.pump(_PENDING_PUMP_S)
        else:
            self._sup.pump()

    def _deliver(self, child: ChildProcess, k: int) -> Any:
        self._metrics.batches += 1
        return self._shape(self._deliver_list(child, k))

    def _shape(self, batch: Batch) -> Any:
        """The batch as the config asks: without INDEX_KEY, and as the one group's dict (both cost a dict op)."""
        cfg = self.config
        if not cfg.index_key:
            del batch[0][INDEX_KEY]
        if cfg.batch_format == "list":
            return batch
        if len(batch) != 1:
            raise ValueError(
                f"DataloaderConfig.batch_format='dict' is invalid for queue {cfg.queue_name!r}: the dataset's chunks "
                f"have {len(batch)} groups, and a dict holds one; use batch_format='list' or yield one group"
            )
        return batch[0]

    def _deliver_list(self, child: ChildProcess, k: int) -> Batch:
        ring = child.ring
        if ring is None:
            raise AssertionError("a batch arrived before its reader's ring")
        if not self.config.evict_on_read:
            _fields, index = ring.regions(k)
            self._versions[index.numpy()] = ring.versions(k)
        if self._placement.moves:
            # The caller gets device tensors and never holds ring memory; the slot is released after the copy.
            child.held += 1
            return self._placement.deliver(ring, k, self._sup.release_later(child, k))
        if child.held >= ring.depth - 1:
            # The caller keeps many batches: hand out a copy so the reader can go on, rather than stall.
            batch = [{key: t.clone() for key, t in group.items()} for group in ring.batch(k)]
            self._sup.send_free(child, k)
            return batch
        child.held += 1
        return self._placement.deliver(ring, k, self._sup.release_later(child, k))

    def _wait_for(self, probe: Any, what: str) -> Any:
        while (found := probe()) is None:
            self._sup.pump()
        return found

    # -- the rest of the API ---------------------------------------------------------------------------------
    def get_dummy_batch(self, timeout_s: float | None = None) -> Any:
        """A batch of ``bs`` copies of the first row of writer 0 of the node's first rank (global rank 0 on node 0),
        for warm-up before the buffer is mixed; it waits for that writer's first chunk (NOTE [ Dummy row ]).

        It does not consume anything from the shuffled stream; its ``INDEX_KEY`` entries are -1. It is on
        ``DataloaderConfig.device`` when one is set. With ``timeout_s``, a ``GigashuffleError`` is raised if the
        row has not come within that many seconds.
        """
        self._check_open()
        if self._dummy is None:
            self._dummy = dummyrow.await_row(
                self._sup.session.store, self._secret, self.config, self._sup.pump, timeout_s
            )
        return self._shape(self._placement.place(dummyrow.batch_of(*self._dummy, self.config.bs)))

    def metrics(self) -> LoaderMetrics:
        """This rank's loader figures, read without the node lock or Redis: totals since it was built, rates and
        shares since the previous call (NOTE [ Metrics ] in trainer/metrics.py; docs/waiting-on-data.md reads
        them). ``.to_prometheus()`` renders them in the Prometheus text format."""
        self._check_open()
        sup = self._sup
        return self._metrics.read(sup.children, sup.table(), sup.restarts)

    def stats(self) -> ShuffleBufferStats:
        """Slot counts of the node buffer (all zero until the first chunk has sized it)."""
        self._check_open()
        return _buffer_stats(self._sup)

    def lock_usage(self) -> LockUsage:
        """The node's slot-table lock: its total hold time and number of holds since the buffer was created (zero
        until then). Two readings over an interval give the share of the node's time that its writers' and
        readers' transitions took; near 1, more of them on this node cannot add throughput
        (NOTE [ Node lock budget ] in shm/slottable.py)."""
        self._check_open()
        table = self._sup.table()
        return LockUsage(0.0, 0) if table is None else table.lock_usage()

    def evict(self, indices: torch.Tensor | npt.ArrayLike) -> int:
        """Return slots to the writers (``evict_on_read=False`` only); returns how many were evicted.

        A slot that a reader is gathering right now is evicted when that reader returns it. Each index names the
        write this trainer last received from that slot: a slot written again since is left alone.
        """
        self._check_open()
        if self.config.evict_on_read:
            raise ValueError("evict() needs DataloaderConfig.evict_on_read=False; with True, reads already evict")
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        ids = np.asarray(indices).reshape(-1)
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.config.shuffle_size):
            raise ValueError(
                f"evict(indices) needs integer slot indices in [0, {self.config.shuffle_size}); got dtype "
                f"{ids.dtype} with range [{ids.min()}, {ids.max()}]. Pass batch[0][INDEX_KEY]."
            )
        if not ids.size:
            return 0
        table = self._wait_for(self._sup.table, "the slot table")
        ids = np.unique(ids)
        return int(table.evict(ids, self._versions[ids], wait_s=_LOCK_PATIENCE_S))

    def attach_training_context(self, context: Any) -> None:
        """Hand ``context`` to every writer; the dataset sees it as ``self.context`` from its next chunk."""
        self._check_open()
        self._sup.context = (True, context)
        self._sup.send_to_writers(SetContext(context))

    def set_epoch(self, epoch: int) -> None:
        """Call ``dataset.set_epoch(epoch)`` in every writer of this rank (now, and in writers started later), as
        ``attach_training_context`` hands over a context; the writers' current passes go on, and the next pass
        of each sees the epoch. A dataset without ``set_epoch`` is left alone (frameworks call this on every
        loader)."""
        self._check_open()
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise TypeError(f"set_epoch(epoch={epoch!r}) needs an int")
        if epoch < 0:
            raise ValueError(f"set_epoch(epoch={epoch}) is invalid: use an epoch number >= 0")
        self.epoch = epoch
        if not callable(getattr(self.dataset, "set_epoch", None)):
            return
        self._sup.epoch = epoch
        self._sup.send_to_writers(SetEpoch(epoch))

    def state_dict(self) -> dict[str, Any]:
        """The dataset's state in every writer of this rank (``dataset.state_dict()``), for checkpoints."""
        self._check_open()
        if not callable(getattr(self.dataset, "state_dict", None)):
            raise TypeError(f"{type(self.dataset).__name__} has no state_dict(); implement state_dict/load_state_dict")
        return datasetstate.collect(self._sup, self.config)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the datasets of this rank's writers from ``state_dict()`` output of the same rank layout."""
        self._check_open()
        if not callable(getattr(self.dataset, "load_state_dict", None)):
            raise TypeError(f"{type(self.dataset).__name__} has no load_state_dict(); implement it to resume")
        datasetstate.restore(self._sup, self.config, state)

    def child_pids(self) -> dict[str, list[int]]:
        """The pids of this loader's live processes by role (``zygote``, ``writer``, ``reader``)."""
        sup = self._sup
        found: dict[str, list[int]] = {"zygote": [sup.zygote.pid], "writer": [], "reader": []}
        for child in sup.children:
            if child.alive and child.pid is not None:
                found[child.role].append(child.pid)
        return found

    def processes(self) -> dict[str, dict[str, Any]]:
        """Every process of this queue on this node as registered in Redis (role, rank, pid, owner, attach)."""
        return self._sup.session.store.processes()

    def wait_started(self, timeout_s: float = 120.0) -> None:
        """Block until every child has a pid (spawned by the zygote); mostly for tests and tools."""
        deadline = time.monotonic() + timeout_s
        while any(c.pid is None for c in self._sup.children if c.alive):
            if time.monotonic() > deadline:
                raise GigashuffleError(f"loader processes did not start within {timeout_s}s")
            self._sup.pump()

    @property
    def seed(self) -> int:
        """The job's base seed: writer ``get_worker_info().id == i`` starts from ``seed + i`` (NOTE [ Seeds ])."""
        return self._sup.seed

    def redis_client(self) -> Client:
        return self._sup.client

    @property
    def closed(self) -> bool:
        return self._sup.closed

    def _check_open(self) -> None:
        if self._sup.closed:
            raise GigashuffleError(f"the loader of queue {self.config.queue_name!r} is closed")
        self._sup.raise_if_failed()

    def close(self) -> None:
        """Stop every loader process and free every resource; calling it again does nothing."""
        if self._progress is not None:
            self._progress.finish(reached=False)
            self._progress = None
        self._finalizer()

    def __enter__(self) -> MultiprocessShuffledDataloader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _buffer_stats(sup: Supervisor) -> ShuffleBufferStats:
    """The node's slot counts at one moment; all zero until a writer has published the buffer."""
    table = sup.table()
    return ShuffleBufferStats(0, 0, 0) if table is None else table.stats(wait_s=_LOCK_PATIENCE_S)


def _counts(sup: Supervisor) -> ShuffleBufferStats:
    """The slot counts from the table's header, without its lock (they never wait: NOTE [ A stopped lock holder ])."""
    table = sup.table()
    return ShuffleBufferStats(0, 0, 0) if table is None else table.counts()[2]


def _stopped_lock_holder(sup: Supervisor) -> str:
    table = sup.table()
    holder = None if table is None else table.lock_holder()
    if holder is None or not is_stopped(holder):
        return ""
    return f"; the node's slot-table lock is held by {describe_process(holder)}"


def _full_slots(sup: Supervisor) -> int:
    sup.raise_if_failed()
    return _counts(sup).full


def _shutdown(placement: pinning.Placement, sup: Supervisor) -> None:
    """The loader's finalizer (it must not refer to the loader): wait for copies out of the rings, then stop."""
    try:
        placement.close()
    finally:
        sup.shutdown()
