"""The dummy batch's row: the first row of writer 0 of the node's first rank, published on its own.

NOTE [ Dummy row ]
Whichever writer seeds the buffer puts its first row in the buffer's metadata, and that is any writer of any rank
that happens to get a chunk first. The dummy batch must not depend on that race (the reference always shows the
first row of writer 0 of rank 0), so writer 0 of the node's first rank (``local_rank == 0``) publishes its own first
row under the ``dummy`` key, signed like the metadata, once it has its first chunk and the buffer exists;
``get_dummy_batch`` waits for that row.

"Rank 0" per node: each node has its own buffer and its own Redis session, and rows of global rank 0 never reach
the buffer of another node, so on node ``n`` the designated writer is writer 0 of global rank
``n * local_world_size`` (local rank 0). On node 0 that is global rank 0, as in the reference.

The first publication wins for the whole session (a respawned writer 0, which draws a fresh stream, does not
change the dummy batch). If the designated writer's share of the data is empty (NOTE [ Empty shares ] in
procs/chunks.py) it publishes that fact instead, and the dummy batch falls back to the first row in the buffer's
metadata, with a log line saying so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.client import Client, address, translate_errors
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.plane import ControlPlane
from gigashuffle.control.signedmeta import verified_layout
from gigashuffle.errors import GigashuffleError, TamperedMetadataError
from gigashuffle.host.secret import sign, verify
from gigashuffle.schema import INDEX_KEY, Layout

log = logging.getLogger(__name__)

_SLOW_WARNING_S = 60.0  # get_dummy_batch() logs a warning this often while it waits


def is_dummy_writer(config: DataloaderConfig, index: int) -> bool:
    """Whether writer ``index`` of this rank is the one whose first row is the node's dummy row."""
    return config.local_rank == 0 and index == 0


def row_bytes(layout: Layout, chunk: Any) -> bytes:
    """The first row of ``chunk`` as the buffer stores it: every field's bytes, in layout order."""
    _rows, as_bytes = layout.rows_in(chunk)
    return b"".join(field[0].numpy().tobytes() for field in as_bytes)


def _row_signature(secret: bytes, generation: str, layout_json: bytes, row: bytes) -> str:
    # The layout is signed with the row, so a row can only be read with the layout it was written for.
    return sign(secret, b"dummy-row", generation.encode(), layout_json, row)


def _absent_signature(secret: bytes, generation: str) -> str:
    return sign(secret, b"dummy-absent", generation.encode())


def publish_row(store: ControlPlane, secret: bytes, generation: str, layout_json: bytes, row: bytes, by: str) -> bool:
    """Publish the dummy row (first publication wins); True if this call published it."""
    signature = _row_signature(secret, generation, layout_json, row)
    result = store.publish_dummy(generation, {"row": row, "layout": layout_json, "hmac": signature, "by": by})
    if result < 0:
        log.debug("dummy row of %s not published: the session %s is gone", by, generation)
    return result == 1


def publish_absent(store: ControlPlane, secret: bytes, generation: str, by: str) -> bool:
    """Record that the designated writer has no rows (an empty share); the dummy batch then falls back."""
    fields: dict[str, bytes | str] = {"absent": b"1", "hmac": _absent_signature(secret, generation), "by": by}
    return store.publish_dummy(generation, fields) == 1


def read(client: Client, keys: QueueKeys) -> dict[str, bytes]:
    with translate_errors(address(client)):
        raw = client.hgetall(keys.dummy)
    # Our clients return bytes; a client made with decode_responses returns str.
    return {
        (k.decode() if isinstance(k, bytes) else k): (v if isinstance(v, bytes) else v.encode()) for k, v in raw.items()
    }


def verified_row(
    secret: bytes, generation: str, published: dict[str, bytes], meta: dict[str, bytes], queue: str
) -> bytes | None:
    """The dummy row from ``published`` (the ``dummy`` hash), None if the designated writer has none; raises
    ``TamperedMetadataError`` if its signature does not check out or it was written for another layout."""
    signature = published.get("hmac", b"")
    if "absent" in published:
        if verify(secret, signature, b"dummy-absent", generation.encode()):
            return None
    elif published.get("layout") == meta["layout"] and verify(
        secret, signature, b"dummy-row", generation.encode(), published["layout"], published.get("row", b"")
    ):
        return published["row"]
    raise TamperedMetadataError(
        f"the dummy row of queue {queue!r} in Redis fails its HMAC check: it was not written by a gigashuffle "
        "process of this user on this machine in this session, or it was modified; refusing to use it"
    )


def verified(
    secret: bytes, generation: str, published: dict[str, bytes], meta: dict[str, bytes], queue: str
) -> tuple[Layout, bytes]:
    """The buffer's layout and the dummy row, both checked against their signatures; the first row in the
    metadata when the designated writer has none (NOTE [ Dummy row ])."""
    layout = verified_layout(secret, generation, meta, queue)
    row = verified_row(secret, generation, published, meta, queue)
    if row is None:
        log.info(
            "queue %r: writer 0 of the node's first rank has no rows (an empty share of a sharded source); "
            "the dummy batch repeats the first row of the writer that created the buffer instead",
            queue,
        )
        row = meta["first_row"]
    return layout, row


def batch_of(layout: Layout, row: bytes, bs: int) -> list[dict[str, torch.Tensor]]:
    """A batch of ``bs`` copies of ``row`` (one row of ``layout``, as bytes), its ``INDEX_KEY`` entries -1."""
    raw_row = memoryview(bytearray(row))  # torch.frombuffer wants a writable buffer (it warns on bytes)
    batch: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.num_groups)]
    offset = 0
    for spec in layout.fields:
        raw = torch.frombuffer(raw_row, dtype=torch.uint8, count=spec.row_bytes, offset=offset)
        value = raw.view(spec.dtype).view(spec.shape)
        batch[spec.group][spec.key] = value.unsqueeze(0).repeat(bs, *([1] * len(spec.shape)))
        offset += spec.row_bytes
    batch[0][INDEX_KEY] = torch.full((bs,), -1, dtype=torch.int64)
    return batch


def await_row(
    store: ControlPlane, secret: bytes, config: DataloaderConfig, pump: Callable[[], None], timeout_s: float | None
) -> tuple[Layout, bytes]:
    """Wait for the dummy row and verify it; ``pump`` runs between polls (the trainer's message pump, which
    raises a child's death). A row read across a rejoin (NOTE [ Rejoining ] in trainer/rejoin.py) fails its check
    against the new generation and is read again in the new session."""
    started = time.monotonic()
    next_warning = started + _SLOW_WARNING_S
    while True:
        generation = store.generation
        while (found := _published(store)) is None:
            now = time.monotonic()
            if timeout_s is not None and now > started + timeout_s:
                raise GigashuffleError(
                    f"queue {config.queue_name!r}: get_dummy_batch(timeout_s={timeout_s}) got no row: writer 0 "
                    "of the node's first rank (local_rank 0) has not produced its first chunk; check that rank's "
                    "dataset, or pass a larger timeout_s"
                )
            if now > next_warning:
                log.warning(
                    "queue %r: get_dummy_batch() has waited %.0f s for the first chunk of writer 0 of the node's "
                    "first rank (local_rank 0); is that rank running?",
                    config.queue_name, now - started,
                )  # fmt: skip
                next_warning += _SLOW_WARNING_S
            pump()
        try:
            return verified(secret, generation, *found, config.queue_name)
        except GigashuffleError:
            if store.generation == generation:
                raise


def _published(store: ControlPlane) -> tuple[dict[str, bytes], dict[str, bytes]] | None:
    """The published dummy row and the buffer's metadata, once both are there."""
    published = read(store.client, store.keys)
    if "hmac" not in published:
        return None
    meta = store.meta()
    return (published, meta) if "hmac" in meta else None
