"""Redis faults: killed and restarted empty mid-run, restarted from an older snapshot, flushed, failed over to a
lagging replica, unreachable at start, and paused (SIGSTOP) for ~3 s.

A restart, a restore or a flush loses or contradicts the node session, never the rows: the buffer and its slot
table live in shared memory. The loader must notice, rejoin under a new generation with the same processes
(every child registered again, the metadata published again) and carry on: no row lost, doubled or torn, and
that whatever ``max_restarts`` allows, since nothing restarts (NOTE [ Rejoining ] in trainer/rejoin.py). Never a
hang. Unreachable at start must be a clear ``RedisUnavailableError`` within ``redis_timeout_s``. A pause shorter
than the socket timeout must be ridden out.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import redis
from chaos_datasets import ID_SHIFT, ChaosDataset
from redis_servers import RedisServer, free_port, wait_until
from reply_dropper import ReplyDropper

from gigashuffle import MultiprocessShuffledDataloader, RedisUnavailableError
from gigashuffle.control.keys import QueueKeys

RESTART_LIMIT_S = 40.0
AFTER_FAULT_BATCHES = 30


def _generation(url: str, keys: QueueKeys) -> bytes | None:
    with redis.Redis.from_url(url, socket_timeout=5.0) as client:
        value = client.get(keys.gen)
    return None if value is None else bytes(value)


def _fault(kind: str, redis_server: Any, rng: Any, consumer: Any) -> float:
    """Inflict ``kind`` on the server; return when (monotonic) the server is back."""
    if kind == "restart":
        redis_server.kill()
        time.sleep(rng.uniform(0.0, 1.5))
        redis_server.restart()
    elif kind == "snapshot":
        with redis_server.client() as client:
            client.save()
        consumer.take(rng.randint(5, 15))  # run on: rows written and read after the snapshot was taken
        redis_server.kill()
        redis_server.restart()
    else:
        with redis_server.client() as client:
            client.flushall()
    return time.monotonic()


def _assert_exactly_the_written_set(writers: list[int], rows_each: int, delivered: list[int]) -> set[int]:
    """Every row each writer wrote (ids ``pid * ID_SHIFT + n``, n < rows_each) delivered once, nothing else."""
    written = {pid * ID_SHIFT + c for pid in writers for c in range(rows_each)}
    doubled = len(delivered) - len(set(delivered))
    lost, stray = sorted(written - set(delivered)), sorted(set(delivered) - written)
    assert (doubled, lost[:10], stray[:10]) == (0, [], []), f"{doubled} doubled, {len(lost)} lost, {len(stray)} stray"
    return written


def _needs_snapshot_dir(redis_server: Any, kind: str) -> Any:
    directory = getattr(redis_server, "directory", None)
    if kind == "snapshot" and directory is None:
        pytest.skip("the snapshot case needs a server whose data directory survives a restart (the binary one)")
    return None if directory is None else directory / "dump.rdb"


@pytest.mark.parametrize(
    ("fault", "max_restarts", "seed"),
    [("restart", 3, 0), ("restart", 3, 1), ("restart", 0, 2), ("snapshot", 3, 0), ("snapshot", 0, 1),
     ("flushall", 3, 0), ("flushall", 0, 1)],
)  # fmt: skip
def test_redis_fault_mid_run_rejoins_with_the_same_processes(
    chaos: Any, redis_server: Any, redis_url: str, fault: str, max_restarts: int, seed: int
) -> None:
    """After the fault the loader carries on with the same children, which register again under a new
    generation; batches keep coming, none twice, none torn, and stats account for every slot."""
    dump = _needs_snapshot_dir(redis_server, fault)
    rng = chaos.begin("Redis fault: rejoin", f"{fault} mid-run, max_restarts={max_restarts}", seed, redis_url)
    cfg = chaos.config(bs=rng.choice((4, 8)), num_readers=rng.choice((1, 2)), max_restarts=max_restarts)
    keys = chaos.keys(cfg)
    loader = chaos.loader(ChaosDataset(rows=8), cfg)
    consumer = chaos.consumer(loader)
    before = 0 if seed == 0 else rng.randint(5, 40)  # seed 0: while the buffer fills, before any batch
    consumer.take(before)
    chaos.find_victim(loader, "owner", rng)  # every child serves the buffer and the owner published it
    loader.wait_started()
    children = loader.child_pids()
    old_generation = _generation(redis_url, keys)
    try:
        back = _fault(fault, redis_server, rng, consumer)
        end = back + RESTART_LIMIT_S
        consumer.take(AFTER_FAULT_BATCHES, timeout_s=RESTART_LIMIT_S)
        # Rejoined: a new generation, and every child (the same processes) registered again and serving. The
        # trainer rejoins from its batch requests, so keep asking.
        while _generation(redis_url, keys) in (None, old_generation) or not chaos.settled(loader):
            assert time.monotonic() < end, f"no rejoin within {RESTART_LIMIT_S} s of the fault"
            consumer.next(timeout_s=max(end - time.monotonic(), 1.0))
        detect_s = time.monotonic() - back
    finally:
        if dump is not None:  # later restarts of this worker's server must come back empty again
            dump.unlink(missing_ok=True)
    new_generation = _generation(redis_url, keys)
    assert new_generation not in (None, old_generation), (old_generation, new_generation)
    assert loader.child_pids() == children, "a child was started again: the rejoin should keep every process"
    assert {info["pid"] for info in loader.processes().values()} == {*children["writer"], *children["reader"]}
    consumer.assert_unique()
    figures = chaos.assert_stats(loader)
    chaos.finish("rejoined", detect_s=detect_s, batches_before=before, **figures)


@pytest.mark.parametrize(("fault", "seed"), [("restart", 0), ("snapshot", 1), ("flushall", 2)])
def test_no_row_lost_or_doubled_across_a_redis_fault(
    chaos: Any, redis_server: Any, redis_url: str, fault: str, seed: int
) -> None:
    """Writers write a known, finite set (then park at a shut gate); the fault comes mid-read. Reading that many
    rows must give exactly that set: the rows in the buffer at the fault are delivered after it."""
    dump = _needs_snapshot_dir(redis_server, fault)
    rng = chaos.begin("Redis fault: nothing lost", f"{fault} mid-read", seed, redis_url)
    chunks, rows = 24, 8  # per writer: 192 rows, 3x the buffer for both writers
    cfg = chaos.config(bs=8, num_readers=rng.choice((1, 2)), min_mixing=0.0)
    loader = chaos.loader(ChaosDataset(rows=rows, gate_dir=str(chaos.gate), allowance=chunks), cfg)
    consumer = chaos.consumer(loader)
    total_batches = 2 * chunks * rows // cfg.bs
    consumer.take(rng.randint(5, 15))
    # A child still starting at the fault is started again (under a new pid, so its ids would differ): begin
    # once every child has the buffer mapped.
    chaos.find_victim(loader, "owner", rng)
    loader.wait_started()
    writers = loader.child_pids()["writer"]
    try:
        back = _fault(fault, redis_server, rng, consumer)
        consumer.take(total_batches - consumer.batches, timeout_s=RESTART_LIMIT_S)
        detect_s = time.monotonic() - back
    finally:
        if dump is not None:
            dump.unlink(missing_ok=True)
    written = _assert_exactly_the_written_set(writers, chunks * rows, consumer.ids)
    assert loader.child_pids()["writer"] == writers
    assert loader.stats().full == 0
    chaos.finish("nothing lost", detect_s=detect_s, rows=len(written))


def _in_sync(replica: RedisServer) -> bool:
    with replica.client(socket_timeout=5.0) as client:
        info = client.info("replication")
    return info.get("master_link_status") == "up" and int(info.get("master_repl_offset", 0)) > 0


@pytest.mark.parametrize("seed", range(2))
def test_failover_to_a_lagging_replica_rejoins_and_loses_nothing(chaos: Any, tmp_path: Any, seed: int) -> None:
    """The loader's address moves from a primary to a replica that stopped replicating a while before (so it holds
    an older copy of every key, the generation and registrations included), as a failover to a lagging replica
    does. Writers write a known, finite set, and the failover comes mid-read: reading that many rows gives exactly
    that set (slot state in Redis gave rows twice here). The replica is another server (another ``run_id``): the
    loader then rejoins with the same processes, and reads on without a row twice."""
    chunks, rows = 24, 8  # per writer: 192 rows, 3x the buffer for both writers
    with (
        RedisServer(tmp_path) as primary,
        RedisServer(tmp_path, extra_args=("--replicaof", "127.0.0.1", str(primary.port))) as replica,
        ReplyDropper(primary.port) as address,
    ):
        try:
            rng = chaos.begin("Redis fault: failover", "to a lagging replica mid-read", seed, address.url)
            cfg = chaos.config(bs=8, num_readers=rng.choice((1, 2)), min_mixing=0.0)
            keys = chaos.keys(cfg)
            loader = chaos.loader(ChaosDataset(rows=rows, gate_dir=str(chaos.gate), allowance=chunks), cfg)
            consumer = chaos.consumer(loader)
            consumer.take(rng.randint(5, 15))
            chaos.find_victim(loader, "owner", rng)  # every child has the buffer mapped (see the test above)
            loader.wait_started()
            children = loader.child_pids()
            wait_until(lambda: _in_sync(replica), timeout_s=30.0, what="the replica to catch up with the primary")
            old_generation = _generation(address.url, keys)
            with replica.client(socket_timeout=5.0) as client:
                client.replicaof("NO", "ONE")  # from here on the replica lags: the primary moves on without it
            consumer.take(rng.randint(5, 15))
            primary.kill()
            address.redirect(replica.port)
            back = time.monotonic()
            consumer.take(2 * chunks * rows // cfg.bs - consumer.batches, timeout_s=RESTART_LIMIT_S)
            written = _assert_exactly_the_written_set(children["writer"], chunks * rows, consumer.ids)
            chaos.open_gate()  # writers go on, so that the trainer's batch requests carry out the rejoin
            while _generation(address.url, keys) in (None, old_generation) or not chaos.settled(loader):
                assert time.monotonic() < back + RESTART_LIMIT_S, f"no rejoin within {RESTART_LIMIT_S} s"
                consumer.next(timeout_s=max(back + RESTART_LIMIT_S - time.monotonic(), 1.0))
            detect_s = time.monotonic() - back
            consumer.take(AFTER_FAULT_BATCHES)
            assert loader.child_pids() == children, "a child was started again: the rejoin should keep every process"
            consumer.assert_unique()
            figures = chaos.assert_stats(loader)
            chaos.finish("rejoined, nothing lost", detect_s=detect_s, rows=len(written), **figures)
        finally:
            chaos.close_all()  # through the address while its server runs (closing twice is harmless)


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
    # What is checked is that redis_timeout_s bounds the wait (not redis-py's retries or a default of tens of
    # seconds); the slack is for a loaded 2-core machine, where the constructor's own work can take seconds.
    assert took <= timeout_s + 5.0, f"RedisUnavailableError came after {took:.1f} s with redis_timeout_s={timeout_s}"


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


def _heartbeat_in_a_redis_call() -> bool:
    """Whether the loader's heartbeat thread is inside one of its beat's Redis calls now."""
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if thread.name == "gigashuffle-heartbeat" and frame is not None:
            return any(f.name == "_lost_at_beat" for f in traceback.extract_stack(frame))
    return False


def test_close_does_not_wait_for_a_heartbeat_stuck_in_a_stopped_redis(
    chaos: Any, redis_server: Any, redis_url: str
) -> None:
    """Redis is stopped (SIGSTOP) while the heartbeat is inside a beat's call, and the loader is closed (as a rank
    does on torchrun's SIGTERM when another rank died with the node's embedded server): close() must not wait for
    that call to give up after redis_timeout_s (30 s; torchrun SIGKILLs a rank 30 s after its SIGTERM, and a
    fresh-clone run saw exactly that). The call ends on its own once Redis is back."""
    chaos.begin("Redis paused at close", "heartbeat inside a call", None, redis_url)
    loader = chaos.loader(ChaosDataset(rows=8), chaos.config(bs=8, num_readers=1))
    chaos.consumer(loader).take(3)
    redis_server.pause()
    try:
        wait_until(_heartbeat_in_a_redis_call, timeout_s=20.0, what="a heartbeat blocked in the stopped Redis")
        closer = chaos.thread(loader.close, "closer")
        closer.join(20.0)  # ~3 s here (2 s of them the closing client's budget); the stuck call alone takes 30 s
        assert not closer.is_alive(), "close() waited for the heartbeat's Redis call"
        closer.result()
    finally:
        redis_server.resume()
    wait_until(lambda: not _heartbeat_in_a_redis_call(), timeout_s=60.0, what="the late beat to end")
    # Redis did not answer at close, so the session was abandoned: its claim expires with its TTL and the next
    # session of the queue cleans up what is left (NOTE [ Heartbeat ]). Take it over and close it for real.
    claim = chaos.keys(loader.config).rank(0)
    with redis_server.client() as client:
        wait_until(lambda: not client.exists(claim), timeout_s=30.0, what="the abandoned claim to expire")
    chaos.consumer(chaos.loader(ChaosDataset(rows=8), chaos.config(bs=8, num_readers=1))).take(3)
    chaos.finish("closed")  # closes the new loader and checks that nothing of either is left (fds, keys, ...)


@pytest.mark.parametrize("seed", range(2))
def test_children_still_starting_at_a_redis_fault_start_again(
    chaos: Any, redis_server: Any, redis_url: str, seed: int
) -> None:
    """Writers held at a gate before their first chunk (so no buffer exists and no child has attached) when
    Redis restarts: they quote a generation that is gone, so each child is started again under the new one (a
    refused call or the trainer's rejoin ends it; neither counts as a failure, even with ``max_restarts=0``), and
    batches come once the gate opens."""
    rng = chaos.begin("Redis fault: children still starting", "restart before the first chunk", seed, redis_url)
    cfg = chaos.config(bs=8, num_readers=rng.choice((1, 2)), max_restarts=0)
    loader = chaos.loader(ChaosDataset(rows=8, gate_dir=str(chaos.gate), allowance=0), cfg)
    loader.wait_started()
    before = loader.child_pids()
    wait_until(lambda: len(chaos.waiting_at_gate()) == cfg.num_writers, timeout_s=60.0, what="writers at the gate")
    redis_server.kill()
    redis_server.restart()
    chaos.open_gate()
    consumer = chaos.consumer(loader)
    consumer.take(20, timeout_s=RESTART_LIMIT_S)
    after = loader.child_pids()
    assert not set(after["writer"]) & set(before["writer"]), (before, after)
    assert not set(after["reader"]) & set(before["reader"]), (before, after)
    consumer.assert_unique()
    figures = chaos.assert_stats(loader)
    chaos.finish("started again", **figures)


def test_a_child_started_while_redis_lists_no_server_attaches_through_the_runtime_directory(
    chaos: Any, redis_server: Any, redis_url: str
) -> None:
    """A new session wipes Redis's list of the processes that serve the buffer, and they list themselves again
    only as each takes the trainer's ``Rejoin``, while the trainer publishes the metadata again at once. A child
    that starts in between finds the metadata and no listed server: it must find one in the runtime directory,
    not wait ``redis_timeout_s`` (30 s) and fail the loader. Here the list is deleted under a running loader and
    the reader is killed: its successor starts while no process is listed."""
    chaos.begin("Redis fault: no server listed", "a reader starts while Redis lists no process", None, redis_url)
    cfg = chaos.config(bs=8, num_readers=1, max_restarts=1)
    loader = chaos.loader(ChaosDataset(rows=8), cfg)
    consumer = chaos.consumer(loader)
    consumer.take(5)
    old_reader = loader.child_pids()["reader"][0]
    with redis_server.client() as client:
        client.delete(chaos.keys(cfg).procs)
    os.kill(old_reader, signal.SIGKILL)
    consumer.take(20, timeout_s=RESTART_LIMIT_S)  # the trainer learns of the death as it pumps for batches
    assert old_reader not in loader.child_pids()["reader"]
    consumer.assert_unique()
    chaos.finish("attached")


@pytest.mark.parametrize(("fault", "seed"), [("restart", 0), ("flushall", 1)])
def test_two_ranks_of_a_node_rejoin_one_session_and_keep_one_buffer(
    chaos: Any, redis_server: Any, redis_url: str, fault: str, seed: int
) -> None:
    """Both ranks notice, join one new session (the first back starts it) and carry on with the node's one
    buffer: each rank still gets rows of both ranks' writers, no id twice across the node, same processes."""
    rng = chaos.begin("Redis fault: two ranks", f"{fault} mid-run", seed, redis_url)
    common = {"bs": 4, "num_writers": 1, "num_readers": 1, "local_world_size": 2, "global_world_size": 2}
    loaders = [chaos.loader(ChaosDataset(rows=8), chaos.config(local_rank=r, global_rank=r, **common)) for r in (0, 1)]
    consumers = [chaos.consumer(loader) for loader in loaders]
    keys = chaos.keys(loaders[0].config)

    def registered() -> set[int]:
        return {info["pid"] for info in loaders[0].processes().values() if info.get("attach")}

    def children() -> set[int]:
        return {pid for loader in loaders for role in ("writer", "reader") for pid in loader.child_pids()[role]}

    end = time.monotonic() + RESTART_LIMIT_S
    while registered() != children() or len(children()) < 4:  # every child of both ranks serves the buffer
        assert time.monotonic() < end, f"registered {registered()}, children {children()}"
        for consumer in consumers:
            consumer.next()
    before, old_generation = children(), _generation(redis_url, keys)
    back = _fault(fault, redis_server, rng, consumers[0])
    end = back + RESTART_LIMIT_S
    writers = [set(loader.child_pids()["writer"]) for loader in loaders]
    seen_after: list[set[int]] = [set(), set()]
    while (
        _generation(redis_url, keys) in (None, old_generation)
        or registered() != before
        or any(seen != writers[0] | writers[1] for seen in seen_after)
    ):
        assert time.monotonic() < end, f"rejoin: registered {registered()} of {before}; writers seen {seen_after}"
        for rank, consumer in enumerate(consumers):
            ids = consumer.next(timeout_s=max(end - time.monotonic(), 1.0))
            seen_after[rank].update(i // ID_SHIFT for i in ids)
    detect_s = time.monotonic() - back
    assert children() == before, "a child was started again: the rejoin should keep every process"
    all_ids = [i for consumer in consumers for i in consumer.ids]
    assert len(all_ids) == len(set(all_ids)), "a row was read twice across the node"
    figures = chaos.assert_stats(loaders[0])
    chaos.finish("rejoined", detect_s=detect_s, **figures)


def _json_or_none(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_rank_started_after_a_flush_finds_the_buffer_redis_forgot(
    chaos: Any, redis_server: Any, redis_url: str
) -> None:
    """Rank 0 runs in a process of its own and is stopped (SIGSTOP) once its children serve the buffer, so no
    trainer publishes the buffer again; Redis is flushed; rank 1 starts. Its writer finds no metadata in Redis and
    finds rank 0's buffer through the runtime directory instead of allocating a second one (NOTE [ A buffer Redis
    forgot ]): rank 1 gets rows that rank 0's writers wrote before the flush, none twice. Rank 0 then goes on."""
    chaos.begin("Redis fault: a rank starts after it", "flushall while the other rank's trainer is stopped", None,
                redis_url)  # fmt: skip
    out, stop_file = chaos.tmp_path / "rank0", chaos.tmp_path / "stop-rank0"
    rank0 = chaos.trainer(out, "--queue", chaos.queue, "--redis-url", redis_url, "--rank", "0", "--ranks", "2",
                          "--stop-file", str(stop_file))  # fmt: skip
    wait_until(lambda: (out / "pids.json").exists() or rank0.poll() is not None, timeout_s=120.0,
               what="rank 0's first batch")  # fmt: skip
    assert rank0.poll() is None, (out / "log").read_text()
    rank0_writers = set(_json_or_none(out / "pids.json")["roles"]["writer"])
    os.kill(rank0.pid, signal.SIGSTOP)
    try:
        with redis_server.client() as client:
            client.flushall()
        node = {"local_world_size": 2, "global_world_size": 2, "local_rank": 1, "global_rank": 1}
        consumer = chaos.consumer(chaos.loader(ChaosDataset(rows=8), chaos.config(**node)))
        end = time.monotonic() + RESTART_LIMIT_S
        while not consumer.writers_seen() & rank0_writers:  # rows from before the flush, in the one buffer
            assert time.monotonic() < end, f"rank 1 saw writers {consumer.writers_seen()}, none of {rank0_writers}"
            consumer.next()
        consumer.assert_unique()
    finally:
        os.kill(rank0.pid, signal.SIGCONT)
    progress = (_json_or_none(out / "progress.json") or {}).get("batches", 0)
    wait_until(
        lambda: (_json_or_none(out / "progress.json") or {}).get("batches", 0) > progress or rank0.poll() is not None,
        timeout_s=RESTART_LIMIT_S, what="rank 0 to go on after SIGCONT",
    )  # fmt: skip
    stop_file.touch()
    end = time.monotonic() + RESTART_LIMIT_S
    while rank0.poll() is None:  # rank 0 may wait for rows that only rank 1's writers now add
        assert time.monotonic() < end, f"rank 0 did not stop:\n{(out / 'log').read_text()[-3000:]}"
        consumer.next()
    assert rank0.returncode == 0, (out / "log").read_text()
    figures = chaos.assert_stats(chaos.loaders[0])
    chaos.finish("one buffer", **figures)
