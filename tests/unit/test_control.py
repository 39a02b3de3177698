"""The control-plane scripts (NOTE [ Control plane ] in control/lua.py) against a real Redis server.

The slot transitions are not here: they live in the slot table (tests/unit/test_slottable.py).
"""

from __future__ import annotations

import json
import threading

import pytest
import redis

from gigashuffle import QueueStateLostError, RedisUnavailableError
from gigashuffle.control.client import Client, run_script
from gigashuffle.control.keys import PREFIX, QueueKeys
from gigashuffle.control.plane import ControlPlane, QueueStats, check_server_version
from gigashuffle.tools.stats import Record, Sample, with_rates

GEN = "gen-1"
KEYS = QueueKeys("slots-test", "n0")


@pytest.fixture
def store(client: Client) -> ControlPlane:
    """A store of the current generation, as NodeSession.join leaves it (the gen key set, nothing seeded)."""
    client.set(KEYS.gen, GEN)
    return ControlPlane(client, KEYS, generation=GEN)


def test_every_key_of_a_queue_shares_one_hash_tag() -> None:
    keys = QueueKeys("train/a@b", "n3")
    all_keys = [*keys.fixed(), keys.rank(12)]
    assert len(set(all_keys)) == len(all_keys)
    for key in all_keys:
        assert key.startswith(f"{PREFIX}:{{train/a@b@n3}}:")
        assert QueueKeys.parse_tag(key) == ("train/a@b", "n3")
    assert QueueKeys.parse_tag("other:{x@y}:gen") is None
    assert QueueKeys.parse_tag(f"{PREFIX}:nobraces") is None


def test_seed_publishes_meta_once(store: ControlPlane) -> None:
    assert store.publish_meta({"layout": "L1", "slots": "10", "first_row": b"\x00\xff", "owner": "w0"}) is True
    assert store.meta() == {"layout": b"L1", "slots": b"10", "first_row": b"\x00\xff", "owner": b"w0"}
    # A retry of the winner's call (a lost reply) still says it won; a second writer loses and changes nothing.
    assert store.publish_meta({"layout": "L1", "slots": "10", "owner": "w0"}) is True
    assert store.publish_meta({"layout": "L2", "slots": "10", "owner": "w1"}) is False
    assert store.meta()["layout"] == b"L1"


def test_stale_generation_is_refused(store: ControlPlane, client: Client) -> None:
    stale = ControlPlane(client, KEYS, generation="gen-0")
    calls = {
        "publish_meta": lambda: stale.publish_meta({"layout": "x", "owner": "w9"}),
    }
    for name, call in calls.items():
        with pytest.raises(QueueStateLostError, match="gen-0") as info:
            call()
        assert "GIGASHUFFLE_STALE" in str(info.value), name
    assert not client.exists(KEYS.meta) and not client.exists(KEYS.counters)  # nothing written


def test_state_lost_after_flush_is_refused(store: ControlPlane, client: Client) -> None:
    assert store.publish_meta({"layout": "x", "owner": "w0"})
    client.flushall()
    with pytest.raises(QueueStateLostError, match="Redis was restarted"):
        store.publish_meta({"layout": "x", "owner": "w0"})
    assert store.extend_claim(0, "token", 1000) is None  # nothing to extend
    assert client.dbsize() == 0  # a stale process recreated nothing


def test_a_claim_is_extended_in_one_command_that_returns_what_it_held(store: ControlPlane, client: Client) -> None:
    """NOTE [ Heartbeat ]: SET ... XX GET extends a claim that exists, says what it held, and creates nothing."""
    assert store.extend_claim(0, "token", 1000) is None  # no claim: nothing written
    assert not client.exists(KEYS.rank(0))
    client.set(KEYS.rank(0), "token", px=100)
    assert store.extend_claim(0, "token", 5000) == "token"
    assert store.extend_claim(0, "token", 5000) == "token"  # as a retried call finds its own write
    assert 1000 < client.pttl(KEYS.rank(0)) <= 5000
    client.set(KEYS.rank(0), "thief", px=1000)
    assert store.extend_claim(0, "token", 5000) == "thief"  # overwritten: the caller gives it back
    assert store.restore_claim(0, "token", "thief", 5000) is True
    assert client.get(KEYS.rank(0)) == b"thief" and client.pttl(KEYS.rank(0)) > 1000
    assert store.restore_claim(0, "token", "thief", 5000) is False  # changed since: left alone
    assert client.get(KEYS.rank(0)) == b"thief"


def test_heartbeats_record_the_node_counts_and_stats_report_the_last(store: ControlPlane, client: Client) -> None:
    assert store.stats() == QueueStats(GEN.encode(), 0, 0, 0, 0)
    store.record_counts((10, 0, 6, 2, 2))
    store.record_counts((10, 4, 3, 5, 2))  # totals, not increments
    store.register("w0", {"role": "writer", "index": 0})
    store.register("r0", {"role": "reader", "index": 0})
    assert store.counters() == (10, 4, 0, 0)  # rows written and read; no reading of the node lock recorded yet
    store.record_counts((11, 5, 3, 5, 2, 7_000, 50_000))
    store.record_counts((12, 6, 3, 5, 2))  # a shorter one leaves the lock's as they are
    assert store.counters() == (12, 6, 7_000, 50_000)
    assert store.stats() == QueueStats(GEN.encode(), 3, 5, 2, 2)
    assert store.processes() == {"w0": {"role": "writer", "index": 0}, "r0": {"role": "reader", "index": 0}}
    assert json.loads(client.hget(KEYS.procs, "r0")) == {"role": "reader", "index": 0}


def test_stats_without_a_session(client: Client) -> None:
    assert ControlPlane(client, KEYS, generation="x").stats() == QueueStats(None, 0, 0, 0, 0)


def test_server_id_is_the_run_id(store: ControlPlane, client: Client) -> None:
    run_id = store.server_id()
    assert len(run_id) == 40 and run_id == client.info("server")["run_id"]


def test_a_script_runs_while_the_script_cache_is_flushed_under_it(client: Client, redis_url: str) -> None:
    """A restart empties the script cache; one between redis-py's own reload and its retried EVALSHA made a writer
    die of NOSCRIPT in the chaos suite. Here another connection flushes the cache as fast as it can while scripts
    run: every call must still return its result."""
    script = client.register_script("return ARGV[1] + 1")
    flusher = redis.Redis.from_url(redis_url)
    stop = threading.Event()

    def flush_until_stopped() -> None:
        while not stop.is_set():
            flusher.script_flush()

    thread = threading.Thread(target=flush_until_stopped, daemon=True)
    thread.start()
    try:
        results = [run_script(script, [], [i]) for i in range(300)]
    finally:
        stop.set()
        thread.join(timeout=30)
        flusher.close()
    assert results == [i + 1 for i in range(300)]


def test_stats_rates_take_the_lock_share_between_the_node_s_own_readings() -> None:
    """``gigashuffle stats``: rates and the lock's busy share come from two heartbeat records on the node's clock,
    whatever the moments ``stats`` sampled at (NOTE [ Stats rates ])."""
    row = {"server": "s", "queue": "q", "node": "n0"}
    first = Record(100, 50, 1_000_000, 5_000_000_000)
    later = Record(300, 250, 251_000_000, 6_000_000_000)
    (rates,) = with_rates([Sample(dict(row), later, first)], [])
    assert (rates["written_per_s"], rates["read_per_s"], rates["lock_busy_pct"]) == (200, 200, 25.0)
    # One record only (the job's first heartbeat): none, unless an earlier frame saw an older one.
    alone = Sample(dict(row), later)
    assert with_rates([alone], [])[0].get("read_per_s") is None
    assert with_rates([alone], [Sample(dict(row), first)])[0]["read_per_s"] == 200
    # Sampled twice between two heartbeats: the same records, the same rate, never 0.
    again = with_rates([Sample(dict(row), later, first)], [Sample(dict(row), later, first)])
    assert again[0]["read_per_s"] == 200
    unread = Sample(dict(row), Record())  # no reading recorded yet (table not mapped)
    assert with_rates([unread], [Sample(dict(row), later, first)])[0].get("lock_busy_pct") is None
    # No live rank claim: the records are a finished job's, not a rate of now.
    ended = Sample({**row, "ranks": 0}, later, first)
    assert with_rates([ended], [])[0].get("read_per_s") is None
    assert with_rates([Sample({**row, "ranks": 1}, later, first)], [])[0]["read_per_s"] == 200
    # Counters that went down: another slot table (a new session), no rate across it.
    restarted = Sample(dict(row), Record(10, 5, 2_000, 7_000_000_000), later)
    assert with_rates([restarted], [])[0].get("read_per_s") is None


def test_each_count_record_carries_the_previous_one(store: ControlPlane) -> None:
    assert store.counter_records() == ((0, 0, 0, 0), (0, 0, 0, 0))
    store.record_counts((10, 4, 3, 5, 2, 7_000, 50_000))
    assert store.counter_records() == ((10, 4, 7_000, 50_000), (0, 0, 0, 0))
    store.record_counts((12, 6, 3, 5, 2, 9_000, 60_000))
    assert store.counter_records() == ((12, 6, 9_000, 60_000), (10, 4, 7_000, 50_000))


@pytest.mark.parametrize(
    ("version", "refused"), [("6.0.16", True), ("5.0.7", True), ("6.2.0", False), ("7.2.4", False), ("", False)]
)
def test_a_server_too_old_for_the_heartbeat_is_refused_with_the_fix(version: str, refused: bool) -> None:
    """The heartbeat's SET ... XX GET needs Redis 6.2 (Valkey reports a newer redis_version); an unknown version
    is let through to fail at the call itself, naming the command."""
    info = {"redis_version": version, "run_id": "x"}
    if not refused:
        check_server_version(info, "redis://old:6379")
        return
    with pytest.raises(RedisUnavailableError, match=rf"redis://old:6379 is version {version}.*6\.2 or newer"):
        check_server_version(info, "redis://old:6379")
