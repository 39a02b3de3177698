"""SIGKILL of the training process itself.

trainer_script.py builds a loader and reads batches; once it has read a random number of them it is killed with
SIGKILL. Every process it started (the zygote, the writers and readers, and with the embedded default the Redis
server) must be gone within 2 s: the zygote sees EOF on its channel and kills the children, which also have
PDEATHSIG; the embedded server has PDEATHSIG against the trainer.

Then a new trainer (this test process) takes the same queue name and rank. It must start at once and read
batches: with an explicit Redis, the dead trainer's rank claim (still within its TTL) names a dead pid on this
host and is dropped, and the stale session's keys are wiped by the new session; with the embedded default, the
dead server's socket file is found stale and a new server is started.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from chaos_datasets import ChaosDataset
from redis_servers import wait_until

from gigashuffle.host.rundir import trainer_sockets

GONE_LIMIT_S = 2.0  # the bound the design promises for a SIGKILLed trainer's processes


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("backend", ["explicit Redis", "embedded Redis"])
def test_sigkilled_trainer_takes_its_processes_along(
    chaos: Any, request: pytest.FixtureRequest, backend: str, seed: int
) -> None:
    url = request.getfixturevalue("redis_url") if backend == "explicit Redis" else None
    rng = chaos.begin("SIGKILL trainer", backend, seed, url)
    out = chaos.tmp_path / "first"
    args = ["--queue", chaos.queue, *(["--redis-url", url] if url else [])]
    trainer = chaos.trainer(out, *args)
    target = rng.randint(1, 40)
    wait_until(
        lambda: (
            trainer.poll() is not None
            or ((_read_json(out / "progress.json") or {}).get("batches", 0) >= target and (out / "pids.json").exists())
        ),
        timeout_s=120.0,
        what=f"the trainer to read {target} batches",
    )
    assert trainer.poll() is None, f"the trainer exited with {trainer.returncode}:\n{(out / 'log').read_text()}"
    time.sleep(rng.uniform(0.0, 0.2))
    pids = _read_json(out / "pids.json")
    victims = [(pid, started) for pid, started, _cmd in pids["descendants"]]
    assert len(victims) >= 4, pids  # zygote, two writers, a reader (and the embedded server)

    killed = time.monotonic()
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(10)
    gone_at: dict[int, float] = {}
    while len(gone_at) < len(victims) and time.monotonic() - killed < GONE_LIMIT_S + 10.0:
        for pid, started in victims:
            if pid not in gone_at and chaos.process_gone(pid, started):
                gone_at[pid] = time.monotonic() - killed
        time.sleep(0.01)
    names = {pid: cmd.split()[0:3] for pid, _started, cmd in pids["descendants"]}
    late = {pid: (names[pid], round(gone_at.get(pid, float("inf")), 2)) for pid, _ in victims
            if gone_at.get(pid, float("inf")) > GONE_LIMIT_S}  # fmt: skip
    assert not late, f"processes of the killed trainer still running {GONE_LIMIT_S} s later (gone after s): {late}"
    gone_s = max(gone_at.values())
    # The trainer served the buffer on a socket of its own (NOTE [ The trainer holds the buffer ]): its zygote, the
    # last of its processes, removed it (the next loader's start would too, so this is looked at before one).
    wait_until(
        lambda: not trainer_sockets(trainer.pid, chaos.runtime_dir),
        timeout_s=10.0,
        what="the killed trainer's attach socket to be removed",
    )

    stale: dict[str, Any] = {}
    if url is not None:
        with redis.Redis.from_url(url) as client:
            stale["rank_claim_ttl_ms"] = int(client.pttl(f"gigashuffle:{{{chaos.queue}@n0}}:rank:0"))
            stale["stale_keys"] = len(list(client.scan_iter(match=chaos.key_pattern)))
        assert stale["rank_claim_ttl_ms"] > 0, "the dead trainer's claim should still be live: the test needs it"
    else:
        stale["stale_server_socket"] = (chaos.runtime_dir / "redis-n0.sock").exists()

    started = time.monotonic()
    loader = chaos.loader(ChaosDataset(rows=8), chaos.config(redis_url=url))
    consumer = chaos.consumer(loader)
    consumer.take(rng.randint(10, 40))
    restart_s = time.monotonic() - started
    consumer.assert_unique()
    assert not consumer.writers_seen() & {pid for pid, _ in victims}, "rows of the dead trainer's writers came back"
    figures = chaos.assert_stats(loader)
    gone = {" ".join(names[pid][:2]): round(t, 2) for pid, t in gone_at.items()}
    chaos.finish("recovered", detect_s=gone_s, restart_s=round(restart_s, 2), gone_after_s=gone, **stale, **figures)
