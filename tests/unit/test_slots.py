"""The slot bookkeeping scripts (NOTE [ Slot states ] in scripts.py) against a real Redis server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from gigashuffle import QueueStateLostError
from gigashuffle.keys import PREFIX, QueueKeys
from gigashuffle.redisconn import Client, connect
from gigashuffle.slots import SlotStore, pack, unpack

GEN = "gen-1"
KEYS = QueueKeys("slots-test", "n0")
NONE = np.empty(0, dtype=np.int32)


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    c = connect(redis_url, total_timeout_s=5.0)
    yield c
    c.close()


@pytest.fixture
def store(client: Client) -> SlotStore:
    """A store of the current generation, as NodeSession.join leaves it (the gen key set, nothing seeded)."""
    client.set(KEYS.gen, GEN)
    return SlotStore(client, KEYS, generation=GEN)


def members(client: Client, key: str) -> set[int]:
    """The slots in ``key``: the full set, or the empty and lease lists (see NOTE [ Slot states ])."""
    if client.type(key) == b"list":
        values = client.lrange(key, 0, -1)
        assert len(set(values)) == len(values), f"{key} lists a slot twice: {values}"
        return {int(m) for m in values}
    return {int(m) for m in client.smembers(key)}


def count(client: Client, key: str) -> int:
    return len(members(client, key))


def ids(slots: np.ndarray) -> set[int]:
    assert slots.dtype == np.int32
    assert len(set(slots.tolist())) == len(slots), f"duplicate slots in {slots}"
    return set(slots.tolist())


def arr(*slots: int) -> np.ndarray:
    return np.array(slots, dtype=np.int32)


def seeded(store: SlotStore, slots: int) -> SlotStore:
    assert store.seed(slots, {"layout": "{}", "slots": str(slots)})
    return store


def fill(store: SlotStore, count: int, proc: str = "w-fill") -> set[int]:
    """Have a writer fill ``count`` slots (empty -> lease -> full); returns them."""
    got = store.writer_cycle(proc, NONE, count)
    assert len(got) == count
    assert len(store.writer_cycle(proc, got, 0)) == 0
    return ids(got)


# -- packing and keys -----------------------------------------------------------------------------------------
def test_pack_is_little_endian_int32_and_unpack_reads_script_replies() -> None:
    assert pack([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert unpack(b"0,7,2147483647").tolist() == [0, 7, 2**31 - 1]
    assert unpack(b"5").tolist() == [5]
    assert unpack(b"").dtype == np.int32
    assert len(unpack(b"")) == 0


def test_every_key_of_a_queue_shares_one_hash_tag() -> None:
    keys = QueueKeys("train/a@b", "n3")
    all_keys = [*keys.fixed(), keys.lease("w0"), keys.rank(12)]
    assert len(set(all_keys)) == len(all_keys)
    for key in all_keys:
        assert key.startswith(f"{PREFIX}:{{train/a@b@n3}}:")
        assert QueueKeys.parse_tag(key) == ("train/a@b", "n3")
    assert QueueKeys.parse_tag("other:{x@y}:gen") is None
    assert QueueKeys.parse_tag(f"{PREFIX}:nobraces") is None


# -- seed -----------------------------------------------------------------------------------------------------
def test_seed_publishes_meta_and_empties_every_slot_once(store: SlotStore, client: Client) -> None:
    assert store.seed(10, {"layout": "L1", "slots": "10", "first_row": b"\x00\xff"}) is True
    assert members(client, KEYS.empty) == set(range(10))
    assert store.meta() == {"layout": b"L1", "slots": b"10", "first_row": b"\x00\xff"}
    # A second writer with its own first chunk loses: nothing changes.
    fill(store, 3)
    assert store.seed(10, {"layout": "L2", "slots": "10"}) is False
    assert store.meta()["layout"] == b"L1"
    assert len(members(client, KEYS.empty)) == 7
    assert len(members(client, KEYS.full)) == 3


def test_seed_handles_more_slots_than_one_lua_unpack(store: SlotStore, client: Client) -> None:
    seeded(store, 10_001)
    assert count(client, KEYS.empty) == 10_001
    got = store.writer_cycle("w0", NONE, 9_000)
    assert len(ids(got)) == 9_000
    again = store.writer_cycle("w0", got, 9_000)  # publishes 9000 and takes the remaining 1001
    assert count(client, KEYS.full) == 9_000
    assert ids(again) == set(range(10_001)) - ids(got)
    batch = store.reader_cycle("r0", NONE, 8_500, 8_500, True)
    assert len(ids(batch)) == 8_500
    assert ids(batch) <= ids(got)
    assert len(store.reader_cycle("r0", batch, 0, 0, True)) == 0
    assert count(client, KEYS.empty) == 8_500
    assert store.evict(np.arange(10_001)) == 500


# -- writers --------------------------------------------------------------------------------------------------
def test_writer_cycle_leases_publishes_and_tops_up(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    first = ids(store.writer_cycle("w0", NONE, 3))
    assert len(first) == 3
    assert members(client, KEYS.lease("w0")) == first
    assert members(client, KEYS.empty) == set(range(8)) - first

    # The writer filled two of its three slots: they become full, and the lease is topped up to three again.
    written = sorted(first)[:2]
    second = ids(store.writer_cycle("w0", arr(*written), 3))
    assert len(second) == 3
    assert set(sorted(first)[2:]) <= second
    assert members(client, KEYS.full) == set(written)
    assert members(client, KEYS.lease("w0")) == second
    assert members(client, KEYS.empty) == set(range(8)) - second - set(written)


def test_writer_cycle_takes_what_is_left_and_then_nothing(store: SlotStore, client: Client) -> None:
    seeded(store, 4)
    got = ids(store.writer_cycle("w0", NONE, 3))
    other = ids(store.writer_cycle("w1", NONE, 3))
    assert len(other) == 1
    assert got.isdisjoint(other)
    assert len(store.writer_cycle("w2", NONE, 3)) == 0
    assert count(client, KEYS.empty) == 0
    # Publishing frees nothing for writers: full slots go to readers, not back to empty.
    assert len(store.writer_cycle("w1", arr(*other), 3)) == 0
    assert members(client, KEYS.full) == other


def test_writer_cycle_want_zero_only_publishes(store: SlotStore, client: Client) -> None:
    seeded(store, 6)
    got = store.writer_cycle("w0", NONE, 4)
    assert len(store.writer_cycle("w0", NONE, 0)) == 4  # still holding: the lease comes back
    left = store.writer_cycle("w0", got[:1], 0)
    assert ids(left) == ids(got[1:])
    assert members(client, KEYS.full) == {int(got[0])}
    assert count(client, KEYS.empty) == 2


def test_writer_cannot_publish_slots_it_does_not_hold(store: SlotStore, client: Client) -> None:
    seeded(store, 6)
    mine = ids(store.writer_cycle("w0", NONE, 2))
    theirs = ids(store.writer_cycle("w1", NONE, 2))
    empty_before = members(client, KEYS.empty)
    # w0 reports w1's slots and an empty slot as written: neither moves.
    bogus = arr(*theirs, *empty_before)
    assert ids(store.writer_cycle("w0", bogus, 2)) == mine
    assert count(client, KEYS.full) == 0
    assert members(client, KEYS.lease("w1")) == theirs
    assert members(client, KEYS.empty) == empty_before


def test_lost_writer_reply_retry_returns_the_same_slots(store: SlotStore, client: Client) -> None:
    seeded(store, 10)
    first = store.writer_cycle("w0", NONE, 3)
    assert ids(store.writer_cycle("w0", NONE, 3)) == ids(first)  # the retry of a lost first reply
    reply = store.writer_cycle("w0", first, 3)
    retry = store.writer_cycle("w0", first, 3)  # the same call again: nothing is published twice or leaked
    assert ids(retry) == ids(reply)
    assert members(client, KEYS.full) == ids(first)
    assert count(client, KEYS.empty) == 4


# -- readers --------------------------------------------------------------------------------------------------
def test_reader_waits_for_the_mixing_threshold(store: SlotStore, client: Client) -> None:
    seeded(store, 10)
    full = fill(store, 3)
    assert len(store.reader_cycle("r0", NONE, 2, 4, True)) == 0  # 3 full < min_full 4
    assert count(client, KEYS.lease("r0")) == 0
    full |= fill(store, 1)
    batch = ids(store.reader_cycle("r0", NONE, 2, 4, True))  # 4 full >= 4
    assert len(batch) == 2
    assert batch <= full
    assert members(client, KEYS.full) == full - batch
    assert members(client, KEYS.lease("r0")) == batch
    # The threshold counts what is full now: another reader finds 2 full slots, under the threshold.
    assert len(store.reader_cycle("r1", NONE, 2, 4, True)) == 0
    assert len(store.reader_cycle("r1", NONE, 2, 2, True)) == 2


def test_reader_want_zero_takes_nothing(store: SlotStore, client: Client) -> None:
    seeded(store, 6)
    fill(store, 6)
    assert len(store.reader_cycle("r0", NONE, 0, 0, True)) == 0
    assert count(client, KEYS.full) == 6


def test_evict_on_read_returns_read_slots_to_empty(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    fill(store, 8)
    batch = store.reader_cycle("r0", NONE, 3, 8, True)
    assert count(client, KEYS.reading) == 0  # only tracked when reads do not evict
    nxt = store.reader_cycle("r0", batch, 3, 5, True)
    assert members(client, KEYS.empty) == ids(batch)
    assert ids(nxt).isdisjoint(ids(batch))
    assert members(client, KEYS.lease("r0")) == ids(nxt)
    # A writer can refill exactly the slots that were read.
    assert ids(store.writer_cycle("w0", NONE, 8)) == ids(batch)


def test_reads_without_eviction_return_slots_to_full(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    fill(store, 8)
    batch = store.reader_cycle("r0", NONE, 3, 8, False)
    assert members(client, KEYS.reading) == ids(batch)
    assert members(client, KEYS.full) == set(range(8)) - ids(batch)
    assert len(store.reader_cycle("r0", batch, 0, 8, False)) == 0
    assert members(client, KEYS.full) == set(range(8))
    assert count(client, KEYS.reading) == 0
    assert count(client, KEYS.empty) == 0
    assert count(client, KEYS.lease("r0")) == 0


def test_lost_reader_reply_retry_returns_the_same_batch(store: SlotStore, client: Client) -> None:
    seeded(store, 12)
    fill(store, 12)
    first = store.reader_cycle("r0", NONE, 4, 4, True)
    retry = store.reader_cycle("r0", NONE, 4, 4, True)  # called again without releasing anything
    assert len(first) == 4
    assert ids(retry) == ids(first)
    assert count(client, KEYS.full) == 8
    # Returning the batch and asking for the next one, twice: the second call hands back the same next batch
    # and does not return the first batch again.
    nxt = store.reader_cycle("r0", first, 4, 4, True)
    again = store.reader_cycle("r0", first, 4, 4, True)
    assert ids(again) == ids(nxt)
    assert members(client, KEYS.empty) == ids(first)
    assert count(client, KEYS.full) == 4


def test_a_reader_returns_its_whole_batch_and_a_wrong_head_returns_nothing(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    fill(store, 8)
    batch = store.reader_cycle("r0", NONE, 4, 4, True)
    # A report that does not start with the lease's head (a stale or foreign batch) releases nothing and hands
    # the lease back unchanged.
    other = arr(*(set(range(8)) - ids(batch)))[:1]
    assert ids(store.reader_cycle("r0", other, 4, 4, True)) == ids(batch)
    assert count(client, KEYS.empty) == 0
    # Reporting the batch by its first slot returns all of it, whatever else the report holds.
    assert len(store.reader_cycle("r0", batch[:1], 0, 4, True)) == 0
    assert members(client, KEYS.empty) == ids(batch)
    assert count(client, KEYS.lease("r0")) == 0


def test_lost_reply_that_repicked_returned_slots_still_yields_a_whole_batch(store: SlotStore, client: Client) -> None:
    # Without evict_on_read, returned slots go back to full and the same call may pick them again: here the
    # reader returns 2 slots and asks for 3 out of 3 full, so its next batch holds both returned slots.
    seeded(store, 3)
    fill(store, 3)
    first = store.reader_cycle("r0", NONE, 2, 2, False)
    reply = store.reader_cycle("r0", first, 3, 3, False)
    assert ids(reply) == {0, 1, 2}
    retry = store.reader_cycle("r0", first, 3, 3, False)  # the reply was lost: the reader only sees this one
    assert ids(retry) == {0, 1, 2}  # a whole batch, not just the slot the retry did not return again
    assert members(client, KEYS.lease("r0")) == {0, 1, 2}
    assert members(client, KEYS.reading) == {0, 1, 2}
    assert count(client, KEYS.full) == 0
    assert count(client, KEYS.empty) == 0


def test_reader_cannot_return_slots_it_does_not_hold(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    fill(store, 8)
    theirs = store.reader_cycle("r1", NONE, 4, 4, True)
    assert len(store.reader_cycle("r0", theirs, 0, 0, True)) == 0
    assert members(client, KEYS.lease("r1")) == ids(theirs)
    assert count(client, KEYS.empty) == 0


# -- evict ----------------------------------------------------------------------------------------------------
def test_evict_full_slots_now(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    full = fill(store, 5)
    writing = ids(store.writer_cycle("w0", NONE, 2))
    victims = sorted(full)[:3]
    # Full slots are evicted; a slot a writer holds and an empty slot are not touched.
    assert store.evict(arr(*victims, *writing, *(set(range(8)) - full - writing))) == 3
    assert members(client, KEYS.full) == full - set(victims)
    assert set(victims) <= members(client, KEYS.empty)
    assert members(client, KEYS.lease("w0")) == writing
    assert count(client, KEYS.evict_pending) == 0
    assert store.evict(arr(*victims)) == 0  # already empty


def test_evict_of_slots_being_read_waits_for_their_reader(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    fill(store, 8)
    batch = store.reader_cycle("r0", NONE, 4, 4, False)
    victim, spared = int(batch[0]), int(batch[1])
    idle = next(iter(members(client, KEYS.full)))
    assert store.evict(arr(victim, idle)) == 2
    assert members(client, KEYS.lease("r0")) == ids(batch)  # the reader keeps gathering its batch
    assert members(client, KEYS.evict_pending) == {victim}
    assert members(client, KEYS.empty) == {idle}
    store.reader_cycle("r0", batch, 0, 0, False)
    assert members(client, KEYS.empty) == {idle, victim}
    assert spared in members(client, KEYS.full)
    assert members(client, KEYS.full) == set(range(8)) - {idle, victim}
    assert count(client, KEYS.evict_pending) == 0
    assert count(client, KEYS.reading) == 0


def test_evict_with_evict_on_read_only_touches_full_slots(store: SlotStore, client: Client) -> None:
    seeded(store, 6)
    fill(store, 6)
    batch = store.reader_cycle("r0", NONE, 2, 2, True)
    assert store.evict(batch) == 0  # nothing deferred: the read itself evicts
    assert count(client, KEYS.evict_pending) == 0


def test_evict_nothing(store: SlotStore) -> None:
    seeded(store, 4)
    assert store.evict(NONE) == 0


# -- reclaim --------------------------------------------------------------------------------------------------
def test_reclaim_of_a_dead_writer_empties_its_slots(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    store.register("w0", {"role": "writer", "pid": 123})
    held = ids(store.writer_cycle("w0", NONE, 3))
    assert store.reclaim("w0", "writer") == 3
    assert members(client, KEYS.empty) == set(range(8))  # rows may be torn: never published
    assert client.exists(KEYS.lease("w0")) == 0
    assert "w0" not in store.processes()
    assert held.isdisjoint(members(client, KEYS.full))
    assert store.reclaim("w0", "writer") == 0  # idempotent


def test_reclaim_of_a_dead_reader_makes_its_batch_full_again(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    fill(store, 8)
    store.register("r0", {"role": "reader", "pid": 456})
    store.register("r1", {"role": "reader", "pid": 457})
    batch = store.reader_cycle("r0", NONE, 3, 3, False)
    assert store.reclaim("r0", "reader") == 3  # never delivered: the rows are still good
    assert members(client, KEYS.full) == set(range(8))
    assert count(client, KEYS.reading) == 0
    assert client.exists(KEYS.lease("r0")) == 0
    assert list(store.processes()) == ["r1"]
    # A late reply from the dead reader's id cannot return slots it no longer holds.
    assert len(store.reader_cycle("r0", batch, 0, 0, False)) == 0
    assert members(client, KEYS.full) == set(range(8))


def test_reclaim_of_a_dead_reader_honours_a_pending_eviction(store: SlotStore, client: Client) -> None:
    seeded(store, 8)
    fill(store, 8)
    batch = store.reader_cycle("r0", NONE, 3, 3, False)
    victim = int(batch[0])
    assert store.evict(arr(victim)) == 1
    assert store.reclaim("r0", "reader") == 3
    # The evicted slot must not be handed to a reader again: it goes to empty, not back to full.
    assert members(client, KEYS.empty) == {victim}
    assert members(client, KEYS.full) == set(range(8)) - {victim}
    assert count(client, KEYS.evict_pending) == 0


# -- generations and stats ------------------------------------------------------------------------------------
def test_stale_generation_is_refused_by_every_transition(store: SlotStore, client: Client) -> None:
    seeded(store, 4)
    fill(store, 2)
    stale = SlotStore(client, KEYS, generation="gen-0")
    calls = {
        "seed": lambda: stale.seed(4, {"layout": "x"}),
        "writer_cycle": lambda: stale.writer_cycle("w0", NONE, 1),
        "reader_cycle": lambda: stale.reader_cycle("r0", NONE, 1, 1, True),
        "evict": lambda: stale.evict(arr(0)),
        "reclaim": lambda: stale.reclaim("w0", "writer"),
    }
    for name, call in calls.items():
        with pytest.raises(QueueStateLostError, match="gen-0") as info:
            call()
        assert "GIGASHUFFLE_STALE" in str(info.value), name
    # Nothing moved.
    assert count(client, KEYS.full) == 2
    assert count(client, KEYS.empty) == 2


def test_state_lost_after_flush_is_refused(store: SlotStore, client: Client) -> None:
    seeded(store, 4)
    client.flushall()
    with pytest.raises(QueueStateLostError, match="Redis was restarted"):
        store.writer_cycle("w0", NONE, 1)
    with pytest.raises(QueueStateLostError):
        store.seed(4, {"layout": "x"})
    assert client.dbsize() == 0  # a stale process recreated nothing


def test_stats_count_slots_and_processes(store: SlotStore, client: Client) -> None:
    assert store.stats() == (GEN.encode(), 0, 0, 0)
    seeded(store, 10)
    fill(store, 4)
    store.writer_cycle("w0", NONE, 2)
    store.reader_cycle("r0", NONE, 1, 1, True)
    store.register("w0", {"role": "writer", "index": 0})
    store.register("r0", {"role": "reader", "index": 0})
    gen, full, empty, procs = store.stats()
    assert (gen, full, empty, procs) == (GEN.encode(), 3, 4, 2)
    assert store.processes() == {"w0": {"role": "writer", "index": 0}, "r0": {"role": "reader", "index": 0}}
    assert json.loads(client.hget(KEYS.procs, "r0")) == {"role": "reader", "index": 0}


def test_stats_without_a_session(client: Client) -> None:
    assert SlotStore(client, KEYS, generation="x").stats() == (None, 0, 0, 0)
