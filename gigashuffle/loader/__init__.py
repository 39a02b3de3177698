"""``MultiprocessShuffledDataloader``: the object a training script iterates."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
import torch

from gigashuffle.checkpoint.checkpoints import Checkpoints
from gigashuffle.config import DataloaderConfig
from gigashuffle.control import dummyrow
from gigashuffle.control.client import Client
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.link import ControlLink
from gigashuffle.errors import GigashuffleError
from gigashuffle.host.rundir import remove_stale_sockets, runtime_dir
from gigashuffle.host.secret import node_secret
from gigashuffle.loader.checkpointing import CheckpointMethods
from gigashuffle.loader.processes import ProcessMethods
from gigashuffle.procs import interrupts
from gigashuffle.procs.interrupts import critical
from gigashuffle.schema import Layout
from gigashuffle.shm.slottable import LockUsage, ShuffleBufferStats
from gigashuffle.sources import missing_state_methods
from gigashuffle.trainer import pinning
from gigashuffle.trainer.batches import Batches
from gigashuffle.trainer.metrics import METRICS_MAX_AGE_S, LoaderMetrics, MetricsReader
from gigashuffle.trainer.supervisor import Supervisor
from gigashuffle.trainer.teardown import at_exit, shutdown

log = logging.getLogger(__name__)

# How long stats() and evict() wait for the node lock before they raise NodeLockBusy (NOTE [ A stopped lock
# holder ] in shm/slottable.py): far longer than any transition holds it.
_LOCK_PATIENCE_S = 30.0


class MultiprocessShuffledDataloader(CheckpointMethods, ProcessMethods):
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
            self._checkpoints = Checkpoints(config)
            self._sup = Supervisor(
                config, dataset, link, str(directory), self._placement, self._checkpoints, stateful=stateful
            )
            self._checkpoints.bind(self._sup)
        except BaseException:
            link.close()
            raise
        self._finalizer = weakref.finalize(self, shutdown, self._placement, self._sup)
        at_exit(self._finalizer)
        interrupts.install()  # NOTE [ Ctrl-C ] in procs/interrupts.py; the finalizer undoes it
        self._metrics = MetricsReader(config.queue_name, config.global_rank, config.shuffle_size, config.bs)
        self._batches = Batches(config, self._sup, self._placement, self._metrics)
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

    def __bool__(self) -> bool:
        """True: ``if loader:`` must not fall back to ``len()``, which an endless loader raises."""
        return True

    def __repr__(self) -> str:
        cfg = self.config
        sup = self.__dict__.get("_sup")  # absent when the constructor failed before it
        state = "closed" if sup is None or sup.closed else "open"
        return (
            f"<MultiprocessShuffledDataloader queue={cfg.queue_name!r} rank={cfg.global_rank} bs={cfg.bs} "
            f"shuffle_size={cfg.shuffle_size} {state}>"
        )

    def __iter__(self) -> Iterator[Any]:
        """Batches as ``list[dict]`` (one dict per group of the dataset's chunks), or a ``dict`` with
        ``DataloaderConfig.batch_format="dict"``; with ``steps_per_epoch``, that many per ``iter()``."""
        self._batches.check_not_a_fork()
        if self.config.num_readers == 0:
            raise GigashuffleError(
                f"queue {self.config.queue_name!r} rank {self.config.global_rank}: this loader has "
                "DataloaderConfig.num_readers=0, so it only feeds the node's buffer and yields no batches; iterate "
                "a loader with num_readers >= 1 (on this rank or another of the node). get_dummy_batch(), stats() "
                "and state_dict() work here."
            )
        self._sup.say_go()  # NOTE [ Restore before reading ] in procs/resume.py
        if self.config.fill_once:
            return self._batches.one_pass()
        return self._batches.stream()

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
                self._sup.session.store, self._secret, self.config, self._batches.pump_before_rows, timeout_s
            )
        return self._batches.shape(self._placement.place(dummyrow.batch_of(*self._dummy, self.config.bs)))

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
        table = self._batches.wait_for(self._sup.table, "the slot table")
        ids = np.unique(ids)
        with critical(blocking=True):  # the node lock is held only inside: NOTE [ Ctrl-C ]
            return int(table.evict(ids, self._batches.versions[ids], wait_s=_LOCK_PATIENCE_S))

    def release_after(self, stream: torch.cuda.Stream) -> None:
        """With ``pin_memory=True`` alone: say that you copy batches to the GPU on ``stream`` too (a prefetcher's
        side stream), for the rest of the loader's life. A batch's ring slot is overwritten by its reader once you
        dropped the batch and the work queued before the drop on the current stream of every GPU, and from now on
        on ``stream``, is done; without this, a copy on a side stream must be ordered onto the current stream before
        you drop the batch (``torch.cuda.current_stream().wait_stream(side)``) or the slot may be refilled under
        the DMA (NOTE [ GPU placement ] in trainer/pinning.py). Nothing to do with ``device=`` (batches are on the
        GPU already) or without pinning (a copy out of pageable memory is staged before it returns)."""
        self._check_open()
        self._placement.release_after(stream)

    def attach_training_context(self, context: Any) -> None:
        """Hand ``context`` to every writer; the dataset sees it as ``self.context`` from its next chunk."""
        self._check_open()
        self._sup.set_context(context)

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
        self._sup.set_epoch(epoch)

    @property
    def batch_size(self) -> int:
        """Rows per batch of this rank: ``DataloaderConfig.bs``, under the name torch's DataLoader and the training
        frameworks read (read-only: the batch size is fixed when the loader is built)."""
        return self.config.bs

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
        self._batches.check_open()

    def close(self) -> None:
        """Stop every loader process and free every resource; calling it again does nothing."""
        self._batches.stop_progress()
        with critical():  # a Ctrl-C meanwhile is raised once every process is stopped (NOTE [ Ctrl-C ])
            self._finalizer()

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"the loader of queue {self.config.queue_name!r} cannot be pickled or copied: it owns processes and shared "
            "memory of the process that opened it. Pickle its dataset and DataloaderConfig instead and open a loader "
            "where they arrive (with Lightning, in train_dataloader(), which runs in every process)"
        )

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
