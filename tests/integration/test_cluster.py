"""The loader, unchanged, against a 3-master Redis Cluster (the ``redis_cluster`` fixture).

``redisconn.connect`` detects cluster mode and hands out a ``RedisCluster`` client; every key of one queue on one
node carries the hash tag ``{<queue>@<node>}``, so all of them live in one hash slot (one shard) and each Lua
script touches a single slot. Different queues hash to different slots and so spread over the shards.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis
from leaks import assert_no_leaks, snapshot
from redis_servers import RedisCluster
from test_torchrun import (
    BATCHES,
    JOB_ARGS,
    JOB_DEADLINE_S,
    _agents,
    _assert_result,
    _launch,
    _report,
    _wait_all,
    _wait_ready,
)
from torchrun_job import UniqueIds, check_of, x_of

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]


def _config(queue: str, url: str) -> DataloaderConfig:
    return DataloaderConfig(bs=8, shuffle_size=256, queue_name=queue, num_writers=1, num_readers=1, redis_url=url)


def _read(loader: MultiprocessShuffledDataloader, batches: int) -> list[int]:
    """Read ``batches`` batches; every row must be whole (its check and x fields match its id)."""
    ids: list[int] = []
    for i, batch in enumerate(loader):
        group = batch[0]
        assert (group["check"] == check_of(group["id"])).all(), "torn row"
        assert (group["x"] == x_of(group["id"])).all(), "torn row"
        ids += group["id"].tolist()
        del batch, group
        if i + 1 == batches:
            break
    return ids


def _queue_keys_by_master(cluster: RedisCluster, queue: str) -> dict[int, list[str]]:
    """Keys of ``queue`` found on each master (by port), scanning every node directly."""
    found: dict[int, list[str]] = {}
    for node in cluster.nodes:
        with node.client() as c:
            keys = sorted(k.decode() for k in c.scan_iter(match=f"gigashuffle:{{{queue}@*"))
        if keys:
            found[node.port] = keys
    return found


def _server_keyslots(cluster: RedisCluster, keys: list[str]) -> set[int]:
    with cluster.nodes[0].client() as c:
        return {int(c.execute_command("CLUSTER", "KEYSLOT", k)) for k in keys}


def test_single_process_loader_on_cluster(
    redis_cluster: RedisCluster, redis_cluster_url: str, runtime_dir: Path
) -> None:
    queue = f"cl-one-{uuid.uuid4().hex[:8]}"
    client = redis_cluster.client()
    try:
        before = snapshot(client, f"gigashuffle:{{{queue}@*", runtime_dir, shm_pattern=f"*{queue}*")
        t0 = time.monotonic()
        with MultiprocessShuffledDataloader(UniqueIds(), _config(queue, redis_cluster_url)) as loader:
            assert isinstance(loader.redis_client(), redis.cluster.RedisCluster)
            ids = _read(loader, 100)
            by_master = _queue_keys_by_master(redis_cluster, queue)
            stats = loader.stats()
        wall = time.monotonic() - t0
        assert len(ids) == 800 and len(set(ids)) == 800
        assert {i >> 32 for i in ids} == {0}  # the single writer of a 1-rank job has worker id 0
        # Every key of the queue sits on one master, in one hash slot (the server's CLUSTER KEYSLOT says so).
        assert len(by_master) == 1, by_master
        keys = next(iter(by_master.values()))
        assert {k.split("}")[0] for k in keys} == {f"gigashuffle:{{{queue}@n0"}
        assert {f"gigashuffle:{{{queue}@n0}}:{name}" for name in ("meta", "procs", "conf", "gen")} <= set(keys)
        assert len(_server_keyslots(redis_cluster, keys)) == 1
        assert_no_leaks(
            before,
            deadline_s=10.0,
            redis_client=client,
            key_pattern=f"gigashuffle:{{{queue}@*",
            runtime_dir=runtime_dir,
            shm_pattern=f"*{queue}*",
        )
        _report(
            "single-process loader, 3-master Redis Cluster",
            wall,
            None,
            f"100 batches, {len(ids)} unique ids; {len(keys)} keys in slot {_server_keyslots(redis_cluster, keys)} "
            f"on master port {next(iter(by_master))}; stats {stats}",
        )
    finally:
        client.close()


def _names_on_different_masters(cluster: RedisCluster) -> tuple[str, str]:
    """Two queue names whose node-0 hash tags the cluster places on different masters."""
    client = cluster.client()
    try:
        first: tuple[str, str] | None = None
        prefix = uuid.uuid4().hex[:6]
        for i in range(64):
            name = f"cl-{prefix}-{i}"
            owner = client.get_node_from_key(f"gigashuffle:{{{name}@n0}}:meta").port
            if first is None:
                first = (name, owner)
            elif owner != first[1]:
                return first[0], name
        raise AssertionError("64 queue names all hashed to one master")
    finally:
        client.close()


def test_two_queues_land_on_different_shards(
    redis_cluster: RedisCluster, redis_cluster_url: str, runtime_dir: Path
) -> None:
    q1, q2 = _names_on_different_masters(redis_cluster)
    t0 = time.monotonic()
    with (
        MultiprocessShuffledDataloader(UniqueIds(), _config(q1, redis_cluster_url)) as l1,
        MultiprocessShuffledDataloader(UniqueIds(), _config(q2, redis_cluster_url)) as l2,
    ):
        ids1, ids2 = _read(l1, 30), _read(l2, 30)
        where1, where2 = _queue_keys_by_master(redis_cluster, q1), _queue_keys_by_master(redis_cluster, q2)
    assert len(set(ids1)) == len(ids1) == 240 and len(set(ids2)) == len(ids2) == 240
    assert len(where1) == 1 and len(where2) == 1, (where1, where2)
    assert set(where1) != set(where2), (where1, where2)
    slots1 = _server_keyslots(redis_cluster, next(iter(where1.values())))
    slots2 = _server_keyslots(redis_cluster, next(iter(where2.values())))
    assert len(slots1) == 1 and len(slots2) == 1 and slots1 != slots2
    _report(
        "two single-process loaders, 3-master Redis Cluster",
        time.monotonic() - t0,
        None,
        f"queue {q1} -> slot {slots1} on master port {set(where1)}; "
        f"queue {q2} -> slot {slots2} on master port {set(where2)}",
    )


@pytest.mark.torchrun
def test_torchrun_one_node_two_ranks_on_cluster(
    redis_cluster: RedisCluster, redis_cluster_url: str, tmp_path: Path, runtime_dir: Path
) -> None:
    queue = f"cl-tr-{uuid.uuid4().hex[:8]}"
    out, hold = tmp_path / "result.json", tmp_path / "hold"
    hold.mkdir()
    t0 = time.monotonic()
    with _agents() as agents:
        agents.append(
            _launch(
                tmp_path,
                [
                    "--queue",
                    queue,
                    "--out",
                    str(out),
                    "--batches",
                    str(BATCHES),
                    "--redis-url",
                    redis_cluster_url,
                    "--hold-dir",
                    str(hold),
                    *JOB_ARGS,
                ],
            )
        )
        ready = _wait_ready(hold, 2, agents, t0 + JOB_DEADLINE_S)
        by_master = _queue_keys_by_master(redis_cluster, queue)
        (hold / "release").touch()
        codes = _wait_all(agents, t0 + JOB_DEADLINE_S)
    wall = time.monotonic() - t0
    assert codes == [0], agents[0].tail()
    result = _assert_result(out, agents, queue, world=2, local_world=2)
    assert len(by_master) == 1, by_master
    keys = next(iter(by_master.values()))
    assert len(_server_keyslots(redis_cluster, keys)) == 1
    # What each rank saw through its own RedisCluster client (SCAN on every primary) is the same one slot.
    seen_by_ranks = sorted({k for r in ready for k in r["keys"]})
    assert {k.split("}")[0] for k in seen_by_ranks} == {f"gigashuffle:{{{queue}@n0"}
    assert _server_keyslots(redis_cluster, seen_by_ranks) == _server_keyslots(redis_cluster, keys)
    assert len({r["meta_owner"] for r in ready}) == 1
    assert _queue_keys_by_master(redis_cluster, queue) == {}
    _report(
        "1 node x 2 ranks, 3-master Redis Cluster", wall, result, f"{len(keys)} keys, one slot, master {set(by_master)}"
    )
