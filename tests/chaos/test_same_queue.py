"""Two trainers claiming the same queue name and global rank.

The second, whether in this process or in another one (trainer_script.py --mode claim), must get
``QueueInUseError`` naming the queue and the rank, and must leave nothing behind; the first keeps reading
batches, with its slot bookkeeping intact. The moment of the second claim is random: before the first loader's
first batch, or after some batches.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from chaos_datasets import ChaosDataset
from redis_servers import wait_until

from gigashuffle import QueueInUseError


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("where", ["same process", "another process"])
def test_second_trainer_on_same_queue_and_rank(
    chaos: Any, request: pytest.FixtureRequest, where: str, seed: int
) -> None:
    backend = "embedded Redis" if seed == 2 else "explicit Redis"
    url = request.getfixturevalue("redis_url") if backend == "explicit Redis" else None
    rng = chaos.begin("same queue + rank", f"{where}, {backend}", seed, url)
    cfg = chaos.config(bs=rng.choice((4, 8)), redis_url=url)
    first = chaos.loader(ChaosDataset(rows=8), cfg)
    consumer = chaos.consumer(first)
    before = 0 if seed == 0 else rng.randint(5, 50)
    consumer.take(before)

    started = time.monotonic()
    if where == "same process":
        with chaos.deadline(60.0, "the second loader's constructor"), pytest.raises(QueueInUseError) as excinfo:
            chaos.loader(ChaosDataset(rows=8), cfg)
        message = str(excinfo.value)
    else:
        out = chaos.tmp_path / "rival"
        rival = chaos.trainer(out, "--mode", "claim", "--queue", chaos.queue, "--bs", str(cfg.bs),
                              *(["--redis-url", url] if url else []))  # fmt: skip
        wait_until(lambda: rival.poll() is not None, timeout_s=120.0, what="the rival trainer to exit")
        assert rival.returncode == 0, (out / "log").read_text()
        claim = json.loads((out / "claim.json").read_text())
        assert claim.get("type") == "QueueInUseError", claim
        message = claim["message"]
    refused_s = time.monotonic() - started
    assert f"queue_name={chaos.queue!r}" in message and "global_rank=0" in message, message

    consumer.take(rng.randint(30, 80))
    consumer.assert_unique()
    figures = chaos.assert_stats(first)
    chaos.finish("error: QueueInUseError (first reads on)", detect_s=refused_s, batches_before=before,
                 message=message[:300], **figures)  # fmt: skip
