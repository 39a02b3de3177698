"""NodeSession (NOTE [ Node sessions ] in control/session.py): rank claims, generations, takeover, leaving."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis_servers import wait_until

from gigashuffle import ConfigMismatchError, DataloaderConfig, GigashuffleError, QueueInUseError
from gigashuffle.control import dummyrow
from gigashuffle.control import session as session_mod
from gigashuffle.control.client import Client
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.session import LEASE_MS, NodeSession, shared_conf
from gigashuffle.host.pids import pid_alive

QUEUE = "sess-q"
NODE0 = QueueKeys(QUEUE, "n0")
DEADLINE_S = 10.0


def config(rank: int, **overrides: Any) -> DataloaderConfig:
    """Rank ``rank`` of a 2-node job with 2 ranks per node: ranks 0 and 1 share node n0, ranks 2 and 3 node n1."""
    base: dict[str, Any] = {
        "bs": 2,
        "shuffle_size": 16,
        "queue_name": QUEUE,
        "num_readers": 1,
        "local_world_size": 2,
        "global_world_size": 4,
        "global_rank": rank,
        "local_rank": rank % 2,
    }
    return DataloaderConfig(**{**base, **overrides})


@pytest.fixture
def join(client: Client) -> Iterator[Callable[[DataloaderConfig], NodeSession]]:
    """Join sessions that are left (heartbeat thread stopped) at teardown, whatever the test did."""
    made: list[NodeSession] = []

    def _join(cfg: DataloaderConfig) -> NodeSession:
        s = NodeSession(client, cfg)
        made.append(s)
        return s

    yield _join
    for s in made:
        with contextlib.suppress(GigashuffleError):  # a test that wiped Redis under the session
            s.leave()
        assert not s._thread.is_alive()


def dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=DEADLINE_S)
    assert not pid_alive(proc.pid)
    return proc.pid


def all_keys(client: Client) -> set[str]:
    return {k.decode() for k in client.scan_iter(match="*", count=1000)}


def test_first_join_starts_a_session(join: Callable[[DataloaderConfig], NodeSession], client: Client) -> None:
    s0 = join(config(0))
    assert s0.generation
    assert client.get(NODE0.gen) == s0.generation.encode()
    assert client.get(NODE0.conf) == shared_conf(config(0)).encode()
    assert client.get(NODE0.rank(0)) == s0.token.encode()
    assert 0 < client.pttl(NODE0.rank(0)) <= LEASE_MS
    host, pid, _ = s0.token.split(":")
    assert (host, int(pid)) == (socket.gethostname(), os.getpid())
    assert s0.other_ranks == [1]
    assert s0.lost is None


def test_second_rank_of_the_node_joins_the_same_generation(
    join: Callable[[DataloaderConfig], NodeSession], client: Client
) -> None:
    s0 = join(config(0))
    s1 = join(config(1, num_writers=5, ring_depth=7))  # settings outside the shared set may differ
    assert s1.generation == s0.generation
    assert s1.token != s0.token
    assert s1.other_ranks == [0]
    assert client.get(NODE0.rank(1)) == s1.token.encode()
    # While one rank stays, a rank that leaves and comes back rejoins the running session.
    assert s0.leave() is False
    again = join(config(0))
    assert again.generation == s1.generation


def test_a_new_session_gets_a_new_generation(join: Callable[[DataloaderConfig], NodeSession]) -> None:
    first = join(config(0))
    generation = first.generation
    assert first.leave() is True
    assert join(config(0)).generation != generation


def test_ranks_of_another_node_run_their_own_session(
    join: Callable[[DataloaderConfig], NodeSession], client: Client
) -> None:
    s0 = join(config(0))
    s2 = join(config(2, bs=4))  # node n1 may even use other settings
    assert s2.config.node == "n1"
    assert s2.other_ranks == [3]
    assert s2.generation != s0.generation
    assert client.get(QueueKeys(QUEUE, "n1").gen) == s2.generation.encode()
    assert client.get(NODE0.gen) == s0.generation.encode()


def test_same_rank_twice_is_refused(join: Callable[[DataloaderConfig], NodeSession], client: Client) -> None:
    s0 = join(config(0))
    with pytest.raises(QueueInUseError) as info:
        join(config(0))
    message = str(info.value)
    assert f"queue_name={QUEUE!r}" in message
    assert "global_rank=0" in message
    assert s0.token in message  # the live holder is named
    assert "another queue_name" in message
    assert "global_rank, local_world_size and global_world_size" in message  # the rank fields are named
    assert "DataloaderConfig.from_env(...)" in message
    assert client.get(NODE0.rank(0)) == s0.token.encode()  # the holder keeps its claim


def test_ranks_left_at_zero_under_torchrun_are_pointed_at_from_env(
    join: Callable[[DataloaderConfig], NodeSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two torchrun ranks whose configs forgot the rank fields both claim rank 0 of a one-rank job.
    monkeypatch.setenv("WORLD_SIZE", "2")
    single = {"local_world_size": 1, "global_world_size": 1, "global_rank": 0, "local_rank": 0}
    join(config(0, **single))
    with pytest.raises(QueueInUseError) as info:
        join(config(0, **single))
    message = str(info.value)
    assert "WORLD_SIZE=2 but its config has global_world_size=1" in message
    assert "DataloaderConfig.from_env(...)" in message


@pytest.mark.parametrize(
    "holder",
    [
        "otherhost.example:{pid}:abc",  # another host: its liveness cannot be checked from here
        f"{socket.gethostname()}:notapid:abc",
    ],
)
def test_a_holder_that_cannot_be_checked_is_not_taken_over(
    join: Callable[[DataloaderConfig], NodeSession], client: Client, holder: str
) -> None:
    value = holder.format(pid=dead_pid())
    client.set(NODE0.rank(0), value, px=LEASE_MS)
    with pytest.raises(QueueInUseError, match="global_rank=0"):
        join(config(0))
    assert client.get(NODE0.rank(0)) == value.encode()


def test_claim_of_a_dead_process_on_this_host_is_taken_over_at_once(
    join: Callable[[DataloaderConfig], NodeSession], client: Client
) -> None:
    stale = f"{socket.gethostname()}:{dead_pid()}:deadbeef0000"
    client.set(NODE0.rank(0), stale, px=LEASE_MS)
    # What the dead job's session left behind: it must not leak into the new one.
    client.set(NODE0.gen, "old-generation")
    client.set(NODE0.conf, '{"bs": 99}')
    client.hset(NODE0.counters, "written", 7)
    client.hset(NODE0.meta, "layout", "old")
    client.hset(NODE0.procs, "w0", json.dumps({"role": "writer"}))

    s0 = join(config(0))
    assert s0.generation != "old-generation"
    assert client.get(NODE0.rank(0)) == s0.token.encode()
    assert client.get(NODE0.conf) == shared_conf(config(0)).encode()
    for key in (NODE0.counters, NODE0.meta, NODE0.procs):
        assert client.exists(key) == 0, key


def test_a_session_restored_from_another_server_is_not_joined(
    join: Callable[[DataloaderConfig], NodeSession], client: Client
) -> None:
    """A snapshot-restored (or failed-over) server brings back an older session with a live-looking claim of
    another rank: that session describes processes and a buffer that may be gone, so a new one starts."""
    client.set(NODE0.gen, "0123456789abcdef0123456789abcdef01234567/old")
    client.set(NODE0.conf, shared_conf(config(0)))
    client.set(NODE0.rank(1), "somehost:1:restored", px=LEASE_MS)
    client.hset(NODE0.meta, "layout", "old")
    s0 = join(config(0))
    run_id = client.info("server")["run_id"]
    assert s0.generation.startswith(run_id + "/") and s0.server_id == run_id
    assert client.exists(NODE0.meta) == 0 and client.exists(NODE0.rank(1)) == 0
    assert join(config(1)).generation == s0.generation  # a rank of the same server joins it


def test_heartbeat_notices_another_server(
    join: Callable[[DataloaderConfig], NodeSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_mod, "HEARTBEAT_S", 0.05)
    s0 = join(config(0))
    assert s0.lost is None
    s0.server_id = "an-earlier-server"  # as if the server had been restarted with all its data since the join
    wait_until(lambda: s0.lost is not None, timeout_s=DEADLINE_S, what="the heartbeat to notice the new run_id")
    assert "run_id" in str(s0.lost)


def test_different_shared_config_is_refused(join: Callable[[DataloaderConfig], NodeSession], client: Client) -> None:
    s0 = join(config(0))
    with pytest.raises(ConfigMismatchError) as info:
        join(config(1, bs=4))
    message = str(info.value)
    assert f"queue_name={QUEUE!r}" in message
    assert '"bs": 2' in message  # what the node runs with
    assert '"bs": 4' in message  # what this rank asked for
    assert isinstance(info.value, ValueError)
    # The refused rank left no claim behind, and the running session is untouched.
    assert client.exists(NODE0.rank(1)) == 0
    assert client.get(NODE0.gen) == s0.generation.encode()
    assert client.get(NODE0.rank(0)) == s0.token.encode()
    # The right settings still join.
    assert join(config(1)).generation == s0.generation


@pytest.mark.parametrize(
    "overrides", [{"shuffle_size": 32}, {"min_mixing": 0.25}, {"evict_on_read": False}], ids=lambda o: next(iter(o))
)
def test_every_shared_field_must_agree(
    join: Callable[[DataloaderConfig], NodeSession], overrides: dict[str, Any]
) -> None:
    join(config(0))
    with pytest.raises(ConfigMismatchError):
        join(config(1, **overrides))


def test_last_leave_deletes_every_key_of_the_queue(
    join: Callable[[DataloaderConfig], NodeSession], client: Client
) -> None:
    s0 = join(config(0))
    s1 = join(config(1))
    other_node = join(config(2))
    store = s0.store
    # A running session: metadata, two registered processes, flushed counters.
    assert store.publish_meta({"layout": "{}", "slots": "10", "owner": "w0"})
    store.register("w0", {"role": "writer"})
    store.register("r0", {"role": "reader"})
    store.record_counts((6, 2, 4, 4, 2))
    assert dummyrow.publish_absent(store, b"secret", store.generation, "w0")  # the dummy row's key
    ours = {k for k in all_keys(client) if QueueKeys.parse_tag(k) == (QUEUE, "n0")}
    expected = {*NODE0.fixed(), NODE0.rank(0), NODE0.rank(1)}
    assert ours == expected

    assert s0.leave() is False  # rank 1 is still there
    assert s0.leave() is False  # idempotent
    assert {k for k in all_keys(client) if QueueKeys.parse_tag(k) == (QUEUE, "n0")} == expected - {NODE0.rank(0)}
    assert s1.leave() is True
    assert [k for k in all_keys(client) if QueueKeys.parse_tag(k) == (QUEUE, "n0")] == []
    # The other node's session is not touched.
    assert client.get(QueueKeys(QUEUE, "n1").gen) == other_node.generation.encode()


def test_heartbeat_keeps_the_claim_alive(
    join: Callable[[DataloaderConfig], NodeSession], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_mod, "HEARTBEAT_S", 0.05)
    s0 = join(config(0))
    client.pexpire(NODE0.rank(0), 1500)  # the claim would lapse in 1.5 s without a heartbeat
    wait_until(
        lambda: client.pttl(NODE0.rank(0)) > 2000, timeout_s=DEADLINE_S, what="the heartbeat to extend the claim"
    )
    assert client.get(NODE0.rank(0)) == s0.token.encode()
    assert s0.lost is None


def test_heartbeat_notices_a_lost_session(
    join: Callable[[DataloaderConfig], NodeSession], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_mod, "HEARTBEAT_S", 0.05)
    s0 = join(config(0))
    client.flushall()  # a Redis restart without persistence
    wait_until(lambda: s0.lost is not None, timeout_s=DEADLINE_S, what="the heartbeat to notice the lost session")
    assert isinstance(s0.lost, GigashuffleError)
    wait_until(lambda: not s0._thread.is_alive(), timeout_s=DEADLINE_S, what="the heartbeat thread to end")


def test_heartbeat_notices_a_stolen_rank(
    join: Callable[[DataloaderConfig], NodeSession], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_mod, "HEARTBEAT_S", 0.05)
    s0 = join(config(0))
    client.set(NODE0.rank(0), "otherhost:1:thief", px=LEASE_MS)
    wait_until(lambda: s0.lost is not None, timeout_s=DEADLINE_S, what="the heartbeat to notice the stolen claim")
    assert isinstance(s0.lost, GigashuffleError)
    # Leaving does not delete a claim that is no longer ours.
    s0.leave()
    assert client.get(NODE0.rank(0)) == b"otherhost:1:thief"


def test_heartbeat_notices_a_replaced_generation_while_the_claim_stays(
    join: Callable[[DataloaderConfig], NodeSession], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The beat's SET sees only the claim; every VERIFY_EVERY-th beat also reads the generation."""
    monkeypatch.setattr(session_mod, "HEARTBEAT_S", 0.05)
    s0 = join(config(0))
    client.set(NODE0.gen, "another-generation")
    wait_until(lambda: s0.lost is not None, timeout_s=DEADLINE_S, what="the heartbeat to notice the new generation")
    assert "another-generation" in str(s0.lost)
    assert client.get(NODE0.rank(0)) == s0.token.encode()  # the claim was never in doubt


def _commands(client: Client) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}


def test_a_heartbeat_costs_a_claim_and_the_counts_and_a_check_every_few_beats(
    join: Callable[[DataloaderConfig], NodeSession], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Heartbeat ]: one SET and one HSET a beat, a GET and an INFO every VERIFY_EVERY beats, nothing else
    (the issue 9 budget: far under one Redis command per hundred batches)."""
    monkeypatch.setattr(session_mod, "HEARTBEAT_S", 0.02)
    s0 = join(config(0))
    s0.counts = lambda: (7, 3, 2, 1, 1, 5_000, 9_000)
    before = _commands(client)
    polls = 0

    def beats() -> int:
        nonlocal polls
        polls += 1
        return _commands(client).get("set", 0) - before.get("set", 0)

    wait_until(lambda: beats() >= 3 * session_mod.VERIFY_EVERY, timeout_s=DEADLINE_S, what="fifteen heartbeats")
    s0.stop_heartbeat()
    after = _commands(client)
    used = {name: calls - before.get(name, 0) for name, calls in after.items() if calls != before.get(name, 0)}
    used["info"] -= polls + 1  # our own readings
    for setup in ("hello", "client|setinfo"):  # a connection's opening, once per pooled connection
        used.pop(setup, None)
    if not used["info"]:
        del used["info"]
    made = used["set"]
    checks = made // session_mod.VERIFY_EVERY
    assert used == {"set": made, "hset": made, "get": checks, "info": checks}, used
    assert client.hmget(NODE0.counters, ["written", "read", "lock_at_ns"]) == [b"7", b"3", b"9000"]
    assert s0.lost is None
