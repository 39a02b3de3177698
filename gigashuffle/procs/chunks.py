"""A writer's chunks: the dataset's, forever; an ended iterator starts the next pass.

NOTE [ Empty shares ]
Writers see a job-wide ``get_worker_info()``, so a source that shards by worker (Hugging Face ``datasets``,
webdataset's ``split_by_worker``) gives a writer nothing when it has fewer shards than the job has writers: every
pass ends at once. After ``writer_max_retries`` such passes in a row the writer idles on its channel (no busy
loop, still answering ``state_dict``), and tries its dataset again after ``load_state_dict`` or a new training
context; it is not a failure. Only if no writer of the node publishes the buffer within a grace period is the
node's data empty, which is an error. A trainer waiting for its first batch does not wait that out: once every writer
of the node has idled so for ``EMPTY_NODE_S`` with no buffer published, its ``next()`` raises a ``SchemaError``
(``EmptyNode`` in trainer/waiting.py). Chunks with zero rows still count towards ``writer_max_retries`` and fail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import get_worker_info

from gigashuffle.control import dummyrow
from gigashuffle.errors import SchemaError
from gigashuffle.procs import firstmix
from gigashuffle.procs.childenv import ChildEnv
from gigashuffle.procs.childspec import ChildSpec
from gigashuffle.procs.positions import Track
from gigashuffle.procs.resume import StreamPosition
from gigashuffle.procs.writercontrol import IDLE_POLL_S, handle_control

log = logging.getLogger(__name__)

# How long a writer with an empty share waits for another writer of its node to publish the buffer before it
# calls the whole node's data empty: generous, since a peer's first chunk may need a slow download.
_EMPTY_SHARE_GRACE_S = 300.0


class Chunks:
    """The dataset's chunks, forever: an ended iterator starts the next pass; too many empty chunks is an error.

    A writer whose share of the dataset is empty (a sharded source with fewer shards than the job has writers:
    every pass ends without a single chunk) idles instead, once another writer has published the node's buffer:
    see NOTE [ Empty shares ].
    """

    def __init__(self, spec: ChildSpec, env: ChildEnv, position: StreamPosition, track: Track) -> None:
        self.dataset = spec.dataset
        self.env = env
        self.position = position
        self.track = track  # NOTE [ Positions checkpoint ] in checkpoint/positions.py
        self.limit = spec.config.writer_max_retries
        self._it: Iterator[Any] | None = None
        self._yielded = False  # whether the current pass has yielded any chunk
        # Called before the writer idles on an empty share: it must not keep empty slots reserved meanwhile.
        self.before_idle: Callable[[], None] = _nothing
        # Called before a loaded state replaces the stream: rows copied from the old one are published first.
        self.before_restart: Callable[[], None] = _nothing

    def restart(self) -> None:
        self._it = None

    def next(self) -> Any:
        empty = barren = 0  # empty chunks or passes in a row; how many of them were passes without any chunk
        while True:
            if self._it is None:
                self._it = iter(self.dataset)
                self._yielded = False
            try:
                chunk = next(self._it)
                self._yielded = True
            except StopIteration:
                self._it = None
                chunk = None
                barren += not self._yielded
            if chunk is not None and not _is_empty(chunk):
                return chunk
            empty += 1
            if empty > self.limit and barren == empty:
                self._idle(barren)
                empty = barren = 0
            elif empty > self.limit:
                raise SchemaError(
                    f"the dataset produced {empty} empty chunks or passes in a row (writer_max_retries="
                    f"{self.limit}); make its __iter__ yield chunks with at least one row"
                )

    def _idle(self, passes: int) -> None:
        """Wait, serving the trainer, until a new context or dataset state may give this writer rows again."""
        info = get_worker_info()
        who = f"writer {self.env.spec.index} (get_worker_info().id={info.id} of {info.num_workers})" if info else ""
        cfg = self.env.config
        log.info(
            "%s of queue %r: the dataset ended %d passes in a row without a chunk, so this writer's share is empty "
            "(a source with fewer shards than the job's writers?); it idles until load_state_dict or a new "
            "training context",
            who, cfg.queue_name, passes,
        )  # fmt: skip
        self.before_idle()
        if dummyrow.is_dummy_writer(cfg, self.env.spec.index):
            env = self.env
            dummyrow.publish_absent(env.store, env.secret, env.spec.generation, env.proc)
        deadline = time.monotonic() + _EMPTY_SHARE_GRACE_S
        published = False
        firstmix.mark_empty_share(self.env, True)  # the node's other writers' first-mix shares grow: NOTE [ First mix ]
        while True:
            if self.env.channel.poll(IDLE_POLL_S) and handle_control(self.env, self):
                firstmix.mark_empty_share(self.env, False)
                return
            if published:
                continue
            published = "hmac" in self.env.store.meta()
            if not published and time.monotonic() > deadline:
                raise SchemaError(
                    f"{who}: the dataset ended {passes} passes in a row without a chunk (writer_max_retries="
                    f"{self.limit}) and no writer of node {cfg.node!r} produced a row within "
                    f"{_EMPTY_SHARE_GRACE_S:.0f} s: the dataset is empty, or its shards are fewer than the job's "
                    "writers and none fell to this node; add shards or use fewer writers"
                )


def _nothing() -> None:
    pass


def _is_empty(chunk: Any) -> bool:
    try:
        group = chunk[0]
        if not isinstance(group, dict):  # a tensor's .values() is the sparse one's: a RuntimeError of torch's
            return False
        first = next(iter(group.values()))
        return (first.shape[0] if type(first) is torch.Tensor else len(first)) == 0  # Tensor.__len__: 0.7 us
    except (TypeError, IndexError, KeyError, StopIteration, AttributeError):
        return False  # malformed: let the layout check explain what is wrong


def before_fetch(chunks: Chunks) -> None:
    """Note the dataset's state before the next chunk (NOTE [ Respawned writers ], [ Positions checkpoint ])."""
    position = chunks.position
    position.before_fetch(chunks.dataset, chunks.env.channel)
    if position.stateful:
        chunks.track.before_chunk(position.produced, position.chunk_state)
