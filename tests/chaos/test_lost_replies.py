"""Lost replies: Redis ran the command, the client never heard back, redis-py retried it.

A pause shorter than the socket timeout never makes redis-py retry; a reply lost after execution does, and a
retried call must be harmless: no slot lost, no row delivered twice or torn. ``ReplyDropper`` (a TCP proxy in
front of the real server) closes the connection instead of forwarding every ``every``-th reply while armed.
"""

from __future__ import annotations

from typing import Any

import pytest
from chaos_datasets import ChaosDataset
from reply_dropper import ReplyDropper

ARMED_BATCHES = 60


@pytest.mark.parametrize("seed", range(3))
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
        proxy.disarm()
        consumer.take(10)  # and it carries on normally afterwards
        dropped = dict(proxy.dropped)
        consumer.assert_unique()
        figures = chaos.assert_stats(loader)  # every slot in exactly one place: none lost to a retried call
        chaos.close_all()  # through the proxy, before it goes
    # The fault really happened, many times (else this test proves nothing).
    assert sum(dropped.values()) >= 5, dropped
    chaos.finish("recovered", every=every, dropped=dropped, batches=consumer.batches, **figures)
