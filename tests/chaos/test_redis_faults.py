"""Redis faults: killed and restarted empty mid-run, restarted from an older snapshot, flushed, unreachable at
start, and paused (SIGSTOP) for ~3 s.

A restart without persistence loses the queue's whole state. With restarts allowed (``max_restarts > 0``) the
loader must recover (a new session: fresh generation, respawned children, rows from new writer processes) within
40 s; with ``max_restarts=0`` it must raise ``QueueStateLostError``. Never a hang. Unreachable at start must be a
clear ``RedisUnavailableError`` within ``redis_timeout_s``. A pause shorter than the socket timeout must be ridden out.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from chaos_datasets import ChaosDataset
from redis_servers import free_port

from gigashuffle import MultiprocessShuffledDataloader, QueueStateLostError, RedisUnavailableError
from gigashuffle.keys import QueueKeys

RESTART_LIMIT_S = 40.0
RECOVERED_BATCHES = 30  # batches of post-restart writers that count as "recovered"


@pytest.mark.parametrize(("max_restarts", "seed"), [(3, 0), (3, 1), (3, 2), (0, 3)])
def test_redis_restart_mid_run(chaos: Any, redis_server: Any, redis_url: str, max_restarts: int, seed: int) -> None:
    rng = chaos.begin("Redis restart", f"killed, restarted empty, max_restarts={max_restarts}", seed, redis_url)
    cfg = chaos.config(bs=rng.choice((4, 8)), num_readers=rng.choice((1, 2)), max_restarts=max_restarts)
    loader = chaos.loader(ChaosDataset(rows=8), cfg)
    consumer = chaos.consumer(loader)
    before = 0 if seed == 0 else rng.randint(5, 60)  # seed 0: while the buffer fills, before any batch
    if before:
        consumer.take(before)
    else:
        chaos.find_victim(loader, "owner", rng)  # every child is up and the buffer is published
    old_writers = set(loader.child_pids()["writer"])
    down_s = rng.uniform(0.0, 1.5)

    faulted = time.monotonic()
    redis_server.kill()
    time.sleep(down_s)
    redis_server.restart()
    end = faulted + RESTART_LIMIT_S
    outcome, detect_s, fresh = None, None, 0
    try:
        while time.monotonic() < end:
            ids = consumer.next(timeout_s=max(end - time.monotonic(), 1.0))
            fresh += sum(1 for i in ids if i // 2**32 not in old_writers) > 0
            if fresh == 1 and detect_s is None:
                detect_s = time.monotonic() - faulted
            if fresh >= RECOVERED_BATCHES:
                outcome = "recovered"
                break
    except QueueStateLostError as exc:
        outcome, detect_s = "error: QueueStateLostError", time.monotonic() - faulted
        assert repr(chaos.queue) in str(exc), str(exc)
        assert max_restarts == 0, f"the loader gave up although max_restarts={max_restarts} allows a restart: {exc}"
    expected = "recovered" if max_restarts else "error: QueueStateLostError"
    assert outcome == expected, (
        f"within {RESTART_LIMIT_S} s of the restart the loader should have {expected}; it delivered "
        f"{fresh} batches of new writers ({consumer.batches} batches in all)"
    )
    consumer.assert_unique()
    extra: dict[str, Any] = {"down_s": round(down_s, 2), "batches_before": before}
    if outcome == "recovered":
        extra.update(chaos.assert_stats(loader))
    chaos.finish(outcome, detect_s=detect_s, **extra)


@pytest.mark.parametrize(("fault", "seed"), [("snapshot", 0), ("snapshot", 1), ("flushall", 0), ("flushall", 1)])
def test_redis_restored_from_an_older_snapshot_or_flushed(
    chaos: Any, redis_server: Any, redis_url: str, fault: str, seed: int
) -> None:
    """A server that comes back with an older snapshot (SAVE, run on, kill, start on the same directory) still
    holds the queue's session: generation, claim, metadata, processes, as they were at the SAVE. One that is
    flushed holds nothing. Either way the loader notices (the restored server has a new run_id), starts a new
    session and batches keep coming; no row is delivered twice or torn, and nothing leaks."""
    directory = getattr(redis_server, "directory", None)
    if fault == "snapshot" and directory is None:
        pytest.skip("the snapshot case needs a server whose data directory survives a restart (the binary one)")
    rng = chaos.begin("Redis restored or flushed", f"{fault} mid-run", seed, redis_url)
    cfg = chaos.config(bs=rng.choice((4, 8)), num_readers=rng.choice((1, 2)), max_restarts=3)
    keys = QueueKeys(cfg.queue_name, cfg.node)
    loader = chaos.loader(ChaosDataset(rows=8), cfg)
    consumer = chaos.consumer(loader)
    consumer.take(rng.randint(5, 30))
    dump = None if directory is None else directory / "dump.rdb"
    old_writers = set(loader.child_pids()["writer"])
    try:
        if fault == "snapshot":
            with redis_server.client() as client:
                client.save()
            consumer.take(rng.randint(5, 30))  # run on: rows written and read after the snapshot was taken
            redis_server.kill()
            redis_server.restart()
            with redis_server.client() as client:
                assert client.exists(keys.gen), "the restarted server did not load the snapshot: the test needs it"
        else:
            with redis_server.client() as client:
                client.flushall()
        faulted = time.monotonic()
        end = faulted + RESTART_LIMIT_S
        before, fresh, detect_s = consumer.batches, 0, None
        # Recovered: batches of writers that did not exist before the fault (the session was noticed and redone).
        while fresh < RECOVERED_BATCHES:
            assert time.monotonic() < end, f"{fresh} batches of new writers within {RESTART_LIMIT_S} s of the fault"
            ids = consumer.next(timeout_s=max(end - time.monotonic(), 1.0))
            fresh += any(i // 2**32 not in old_writers for i in ids)
            if fresh == 1:
                detect_s = time.monotonic() - faulted
    finally:
        if dump is not None:  # later restarts of this worker's server must come back empty again
            dump.unlink(missing_ok=True)
    consumer.assert_unique()
    figures = chaos.assert_stats(loader)
    chaos.finish("recovered", detect_s=detect_s, batches_before=before, **figures)


@pytest.mark.parametrize(
    ("case", "seed"),
    [
        *(("connection refused", seed) for seed in range(3)),
        *(("missing unix socket", seed) for seed in range(3)),
        ("server accepts but never answers (SIGSTOP)", 1),
    ],
)
def test_redis_unreachable_at_start(chaos: Any, redis_server: Any, case: str, seed: int) -> None:
    timeout_s = (1.0, 2.0, 3.0)[seed]
    rng = chaos.begin("Redis unreachable at start", f"{case}", seed, None)
    del rng
    if case == "connection refused":
        url = f"redis://127.0.0.1:{free_port()}/0"
    elif case == "missing unix socket":
        url = f"unix://{chaos.tmp_path}/no-such-redis.sock"
    else:
        url = redis_server.url
        redis_server.pause()
    try:
        started = time.monotonic()
        with chaos.deadline(60.0, "the loader constructor"), pytest.raises(RedisUnavailableError) as excinfo:
            MultiprocessShuffledDataloader(ChaosDataset(), chaos.config(redis_url=url, redis_timeout_s=timeout_s))
        took = time.monotonic() - started
    finally:
        if case.startswith("server accepts"):
            redis_server.resume()
    text = str(excinfo.value)
    # Record and check leaks first, so that the known-slow case still reports its time and leak figures.
    chaos.finish("error: RedisUnavailableError", detect_s=took, redis_timeout_s=timeout_s, message=text[:300])
    assert "redis_timeout_s" in text, text
    where = url.removeprefix("unix://") if url.startswith("unix://") else url.split("//", 1)[1].split("/", 1)[0]
    assert where in text, f"the error does not say which Redis ({where}): {text}"
    assert took <= timeout_s + 1.0, f"RedisUnavailableError came after {took:.1f} s with redis_timeout_s={timeout_s}"


@pytest.mark.parametrize("seed", range(3))
def test_redis_paused_then_resumed(chaos: Any, redis_server: Any, redis_url: str, seed: int) -> None:
    rng = chaos.begin("Redis paused ~3 s", "SIGSTOP then SIGCONT mid-run", seed, redis_url)
    loader = chaos.loader(ChaosDataset(rows=8), chaos.config(bs=rng.choice((4, 8)), num_readers=rng.choice((1, 2))))
    consumer = chaos.consumer(loader)
    consumer.take(rng.randint(1, 50))
    pause_s = rng.uniform(2.5, 3.5)

    def pause() -> float:
        redis_server.pause()
        try:
            time.sleep(pause_s)
        finally:
            redis_server.resume()
        return time.monotonic()

    paused = time.monotonic()
    pauser = chaos.thread(pause, "pauser")
    while pauser.is_alive():  # read through the pause: batches already in the rings, then nothing, then more
        consumer.next()
    pauser.result()
    consumer.take(rng.randint(30, 60))
    consumer.assert_unique()
    figures = chaos.assert_stats(loader)
    stall_s = max(took for called, took in consumer.waits if called + took >= paused)
    # detect_s: the longest the trainer waited in one next() call from the pause on (the stall it saw)
    chaos.finish("recovered", detect_s=stall_s, pause_s=round(pause_s, 2), **figures)
