"""Lost replies: Redis ran the command, the client never heard back, redis-py retried it.

A pause shorter than the socket timeout never makes redis-py retry; a reply lost after execution does, and a
retried call must be harmless: no slot lost, no row delivered twice or torn. ``ReplyDropper`` (a TCP proxy in
front of the real server) closes the connection instead of forwarding every ``every``-th reply while armed.
Slots live in shared memory, so what goes through the proxy is the control plane (heartbeats, ``run_id``
checks, counter flushes a few times a second): the test reads on while armed until enough replies were lost.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from chaos_datasets import ChaosDataset
from reply_dropper import ReplyDropper

ARMED_BATCHES = 60
DROPS = 5
ARMED_LIMIT_S = 60.0


@pytest.mark.parametrize("seed", range(2))
def test_retried_calls_after_lost_replies_lose_and_double_nothing(
    chaos: Any, redis_server: Any, redis_url: str, seed: int
) -> None:
    rng = chaos.begin("Lost replies", "executed, reply dropped, retried", seed, redis_url)
    every = rng.choice((3, 5, 7))
    with ReplyDropper(redis_server.port) as proxy:
        cfg = chaos.config(bs=rng.choice((4, 8)), num_readers=rng.choice((1, 2)), redis_url=proxy.url)
        loader = chaos.loader(ChaosDataset(rows=8), cfg)
        consumer = chaos.consumer(loader)
        consumer.take(5)
        proxy.arm(every)
        consumer.take(ARMED_BATCHES)
        armed_until = time.monotonic() + ARMED_LIMIT_S
        while sum(proxy.dropped.values()) < DROPS and time.monotonic() < armed_until:
            consumer.take(1)
        proxy.disarm()
        consumer.take(10)  # and it carries on normally afterwards
        dropped = dict(proxy.dropped)
        consumer.assert_unique()
        figures = chaos.assert_stats(loader)  # every slot in exactly one place: none lost to a retried call
        chaos.close_all()  # through the proxy, before it goes
    # The fault really happened, many times (else this test proves nothing).
    assert sum(dropped.values()) >= DROPS, dropped
    chaos.finish("recovered", every=every, dropped=dropped, batches=consumer.batches, **figures)
