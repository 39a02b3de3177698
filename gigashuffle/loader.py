"""``MultiprocessShuffledDataloader``: the object a training script iterates."""

from __future__ import annotations

import atexit
import functools
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.control import dummyrow
from gigashuffle.control.client import Client
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.link import ControlLink
from gigashuffle.errors import CheckpointError, GigashuffleError
from gigashuffle.host.pids import describe_process, is_stopped
from gigashuffle.host.rundir import remove_stale_sockets, runtime_dir
from gigashuffle.host.secret import node_secret
from gigashuffle.procs import interrupts
from gigashuffle.procs.firstmix import FIRST_MIX_WAIT_S, share
from gigashuffle.procs.interrupts import critical
from gigashuffle.procs.messages import SetContext, SetEpoch, StartPass
from gigashuffle.procs.zygoteclient import ChildProcess
from gigashuffle.schema import INDEX_KEY, Layout
from gigashuffle.shm.slottable import LockUsage, ShuffleBufferStats
from gigashuffle.sources import missing_state_methods
from gigashuffle.trainer import datasetstate, pinning, progress
from gigashuffle.trainer.metrics import METRICS_MAX_AGE_S, LoaderMetrics, MetricsReader
from gigashuffle.trainer.supervisor import Supervisor

log = logging.getLogger(__name__)

Batch = list[dict[str, torch.Tensor]]
_SLOW_WARNING_S = 60.0
# How long stats() and evict() wait for the node lock before they raise NodeLockBusy (NOTE [ A stopped lock
# holder ] in shm/slottable.py): far longer than any transition holds it.
_LOCK_PATIENCE_S = 30.0
# How often the trainer looks at pending ring releases while it waits for a batch (NOTE [ GPU placement ]).
_PENDING_PUMP_S = 0.002


class MultiprocessShuffledDataloader:
    """Iterate over shuffled batches drawn from the node-wide shared buffer.

    Batches are zero-copy views into this rank's reader rings: a ring slot is reused only after every tensor of
    its batch (and every view of one) is gone, so a batch stays valid while the caller holds it. A caller that
    holds more batches than the ring has room for gets copies instead, never a stall. With
    ``DataloaderConfig.device="cuda:N"`` batches are on that device instead (NOTE [ GPU placement ]).
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
        link = ControlLink.open(config)
        self.redis_url = link.url
        try:
            stateful = missing_state_methods(dataset) is None
            self._sup = Supervisor(config, dataset, link, str(directory), stateful=stateful)
        except BaseException:
            link.close()
            raise
        self._sup.on_ring = self._placement.adopt  # rings are registered with CUDA when they arrive, not on a batch
        self._finalizer = weakref.finalize(self, _shutdown, self._placement, self._sup)
        _at_exit(self._finalizer)
        interrupts.install()  # NOTE [ Ctrl-C ] in procs/interrupts.py; _shutdown undoes it
        self._pass_open = False
        # The version of the write each slot held when this trainer last received it: evict() names that write,
        # so a late evict never drops a newer row (-1: never received here, evict whatever the slot holds).
        self._versions = np.full(config.shuffle_size, -1, dtype=np.int64)
        # Filling progress is shown while this rank waits for its first batch, then never again.
        self._progress: progress.FillProgress | None = None
        self._first_batch_seen = False
        self._late_writers_due = time.monotonic() + FIRST_MIX_WAIT_S  # NOTE [ First mix ] in procs/firstmix.py
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
        self._sup.say_go()  # NOTE [ Restore before reading ] in procs/resume.py
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
        with critical():  # a pass asked for is a pass open: NOTE [ Ctrl-C ]
            sup.passes_ended.discard(0)
            reader.channel.send(StartPass(0))
            self._pass_open = True
        while True:
            while not sup.ready and 0 not in sup.passes_ended:
                self._show_filling()
                self._pump()
            self._filled()
            if sup.ready:
                with critical():
                    batch = self._deliver(*sup.ready.popleft())
                yield batch
            else:
                sup.passes_ended.discard(0)
                self._pass_open = False
                return

    def _finish_open_pass(self) -> None:
        """Discard the rest of a pass the caller abandoned, so the next pass starts at its first batch."""
        sup = self._sup
        while self._pass_open:
            while sup.ready:
                with critical():
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
        sup.say_go()
        # Return the ring slots of dropped batches first (those whose copies are done, with pinned rings): all of
        # them when the trainer is about to wait, else those of readers with half their ring to come back (NOTE
        # [ Batched frees ]).
        self._placement.poll()
        sup.flush_frees(everything=not sup.ready)
        if not sup.ready:
            self._wait_for_batch()
        self._filled()
        # Popped and handed over in one section: a batch popped and never made is a ring slot lost for good. A Ctrl-C
        # meanwhile drops this batch on the way out, and its slot returns like any dropped batch's (NOTE [ Ctrl-C ]).
        with critical():
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
        if time.monotonic() > self._late_writers_due:
            self._late_writers_due = float("inf")
            _log_late_writers(self._sup)
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
        if child.held >= ring.depth - 1 and self._placement.pending:
            self._await_copies(child, ring.depth - 1)
        if child.held >= ring.depth - 1:
            # The caller keeps many batches: hand out a copy so the reader can go on, rather than stall.
            batch = [{key: t.clone() for key, t in group.items()} for group in ring.batch(k)]
            self._sup.send_free(child, k)
            return batch
        child.held += 1
        return self._placement.deliver(ring, k, self._sup.release_later(child, k))

    def _await_copies(self, child: ChildProcess, limit: int) -> None:
        """Pinned rings: wait for the oldest pending copies until ``child`` holds fewer than ``limit`` slots, rather
        than hand out a pageable copy for slots the caller already dropped (NOTE [ GPU placement ])."""
        placement = self._placement
        while child.held >= limit and placement.pending:
            if not placement.poll():
                placement.poll(wait=True)
            self._sup.flush_frees(everything=False)

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

    def metrics(self, max_age_s: float = METRICS_MAX_AGE_S) -> LoaderMetrics:
        """This rank's loader figures, read without the node lock or Redis: totals since it was built, rates and
        shares since the previous reading (NOTE [ Metrics ] in trainer/metrics.py; docs/waiting-on-data.md reads
        them). A reading less than ``max_age_s`` old is returned as it is (cheap enough to call every batch); 0
        reads afresh. ``.to_prometheus()`` renders them in the Prometheus text format."""
        self._check_open()
        if (last := self._metrics.fresh(max_age_s)) is not None:
            return last
        if not max_age_s >= 0:
            raise ValueError(f"metrics(max_age_s={max_age_s!r}) is invalid: give seconds >= 0 (0 reads afresh)")
        sup, placement = self._sup, self._placement
        h2d = (placement.h2d_s, placement.h2d_copies) if placement.moves else None
        return self._metrics.read(sup.children, sup.table(), sup.restarts, h2d)

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
        if table is None:
            return LockUsage(0.0, 0)
        with critical(blocking=True):
            return table.lock_usage()

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
        with critical(blocking=True):  # the node lock is held only inside: NOTE [ Ctrl-C ]
            return int(table.evict(ids, self._versions[ids], wait_s=_LOCK_PATIENCE_S))

    def attach_training_context(self, context: Any) -> None:
        """Hand ``context`` to every writer; the dataset sees it as ``self.context`` from its next chunk."""
        self._check_open()
        self._sup.context = context
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
        """This rank's checkpoint: ``{f"rank{global_rank}": {...}}`` with the dataset's state in each of its writers
        (NOTE in trainer/datasetstate.py). The dicts of all ranks merge with ``dict.update``; a writer that is dead
        or being started again is waited for (up to a minute), never a crash."""
        self._check_open()
        self._require_state_methods("state_dict")
        return datasetstate.collect(self._sup, self.config)

    def gathered_state_dict(self) -> dict[str, Any]:
        """Every rank's ``state_dict()`` merged (``all_gather_object`` when ``torch.distributed`` is initialized; a
        collective, so every rank must call it), for frameworks that save the loader's state from rank 0 only."""
        mine = self.state_dict()
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return mine
        parts: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, mine)
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's writers from its part, ``state[f"rank{global_rank}"]``, of a checkpoint of the same
        rank layout (merged or not). Called before the first batch, no row of the dataset is read before it (NOTE
        [ Restore before reading ] in procs/resume.py)."""
        self._check_open()
        self._require_state_methods("load_state_dict")
        datasetstate.restore(self._sup, self.config, state)

    def _require_state_methods(self, caller: str) -> None:
        why = missing_state_methods(self.dataset)
        if why is not None:
            raise CheckpointError(
                f"{caller}: the dataset {type(self.dataset).__name__} of queue {self.config.queue_name!r} cannot be "
                f"checkpointed: {why}"
            )

    def child_pids(self, timeout_s: float = 120.0) -> dict[str, list[int]]:
        """The pids of this loader's live processes by role (``zygote``, ``writer``, ``reader``). The zygote forks
        the children after the constructor returns and reports their pids through the channel: this waits up to
        ``timeout_s`` for every live child's pid, so the lists are complete right after construction too."""
        self.wait_started(timeout_s)
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
        with critical():  # a Ctrl-C meanwhile is raised once every process is stopped (NOTE [ Ctrl-C ])
            self._finalizer()

    def __enter__(self) -> MultiprocessShuffledDataloader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _buffer_stats(sup: Supervisor) -> ShuffleBufferStats:
    """The node's slot counts at one moment; all zero until a writer has published the buffer."""
    table = sup.table()
    if table is None:
        return ShuffleBufferStats(0, 0, 0)
    with critical(blocking=True):  # the node lock is held only inside: NOTE [ Ctrl-C ]
        return table.stats(wait_s=_LOCK_PATIENCE_S)


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


def _log_late_writers(sup: Supervisor) -> None:
    late = sorted(c.index for c in sup.writers() if c.index not in sup.mix_shares)
    if late:
        cfg = sup.config
        log.warning(
            "queue %r rank %d: writers %s have not written their share (%d rows) of the node's first mix after "
            "%.0f s; the first batch waits for every writer's share, but a writer whose share is in waits at most "
            "%.0f s for the others (NOTE [ First mix ] in procs/firstmix.py)",
            cfg.queue_name, cfg.global_rank, late, share(cfg), FIRST_MIX_WAIT_S, FIRST_MIX_WAIT_S,
        )  # fmt: skip


def _full_slots(sup: Supervisor) -> int:
    sup.raise_if_failed()
    return _counts(sup).full


def _shutdown(placement: pinning.Placement, sup: Supervisor) -> None:
    """The loader's finalizer (it must not refer to the loader): wait for copies out of the rings, then stop
    (NOTE [ Shutdown ] in trainer/supervisor.py)."""
    with critical(deliver=False):  # whether closed, collected or run at exit: NOTE [ Ctrl-C ]
        try:
            placement.close()
        finally:
            sup.shutdown()
            interrupts.uninstall()


# NOTE [ Loaders at exit ]
# A loader never closed is closed at interpreter exit by this module's atexit hook, not by weakref.finalize's own:
# atexit runs the last registered first, and the hook is registered after the first loader's finalizer exists (so
# after weakref's), so it runs before weakref.finalize's exit pass. That pass runs the newest finalizers first,
# among them those of the objects a loader made after itself: the node lock's, which closes the lock's fd, used to
# run before the loader's shutdown, whose repair then failed with "OSError: [Errno 9] Bad file descriptor".
_OPEN_LOADERS: set[weakref.finalize[Any, Any]] = set()
_HOOKED = False


def _at_exit(finalizer: weakref.finalize[Any, Any]) -> None:
    global _HOOKED
    for done in [f for f in _OPEN_LOADERS if not f.alive]:
        _OPEN_LOADERS.discard(done)
    _OPEN_LOADERS.add(finalizer)
    if not _HOOKED:
        _HOOKED = True
        atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    interrupts.set_exiting()  # a Ctrl-C from now on must not cut the teardown (NOTE [ Ctrl-C ])
    with critical(deliver=False):
        while _OPEN_LOADERS:
            _OPEN_LOADERS.pop()()


interrupts.protect(_close_at_exit.__code__)
