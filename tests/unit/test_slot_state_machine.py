"""Random sequences of slot transitions against a real Redis, checked against a model after every call.

The model mirrors NOTE [ Slot states ] in gigashuffle/scripts.py exactly: ``empty`` is a list (writers take
from its head, returned slots go to its tail), ``full`` a set, and each process's lease a list in the order its
slots were handed out. A writer reports the first ``n`` slots of its lease, a reader its whole batch, both by
the first slot only; a report whose first slot is not the lease head commits nothing. Every Redis key is
compared with the model after every call (between a call and its retry too), order included for the lists.

The model also follows which sample each slot holds: a writer that publishes a slot gives it a fresh sample
id, and a sample that was read with evict_on_read=True, or evicted, must never reach a reader again.

The only thing the model cannot predict is which full slots SPOP hands to a reader, and in which order: it
takes them from the reply, after checking they were full, and follows that order from then on.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from gigashuffle.keys import QueueKeys
from gigashuffle.redisconn import Client, connect
from gigashuffle.slots import SlotStore

SLOTS = 12
BS = 3
PREFILL = "w-init"
WRITERS = ("w0", "w1")
READERS = ("r0", "r1", "r2")
PROCS = (PREFILL, *WRITERS, *READERS)
GEN = "machine-gen"
KEYS = QueueKeys("machine", "n0")

# The first slot of a confused report (one in four): any slot, whatever the process holds.
BOGUS = st.one_of(st.none(), st.none(), st.none(), st.integers(0, SLOTS - 1))

SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def arr(slots: list[int]) -> np.ndarray:
    return np.array(slots, dtype=np.int32)


def as_list(reply: np.ndarray) -> list[int]:
    assert reply.dtype == np.int32
    values = [int(s) for s in reply.tolist()]
    assert len(values) == len(set(values)), f"a reply named a slot twice: {values}"
    return values


class SlotMachine(RuleBasedStateMachine):
    def __init__(self, client: Client, evict_on_read: bool) -> None:
        super().__init__()
        self.client = client
        self.evict_on_read = evict_on_read
        client.flushdb()  # this worker's private server; every example starts from a fresh session
        client.set(KEYS.gen, GEN)
        self.store = SlotStore(client, KEYS, generation=GEN)
        assert self.store.seed(SLOTS, {"layout": "{}", "slots": str(SLOTS)})
        self.empty: list[int] = list(range(SLOTS))  # seed pushes the slots in order
        self.full: set[int] = set()
        self.lease: dict[str, list[int]] = defaultdict(list)
        self.reading: set[int] = set()  # slots leased to readers, tracked by Redis only without evict_on_read
        self.pending: set[int] = set()  # evicted while being read
        self.sample: dict[int, int | None] = dict.fromkeys(range(SLOTS))
        self.next_sample = 0
        self.gone: set[int] = set()  # samples consumed or evicted: never to be handed to a reader again
        self.check_redis()

    @initialize(count=st.integers(0, SLOTS))
    def prefill(self, count: int) -> None:
        """Start most examples with full slots, so that readers get batches within a few steps."""
        got = self.call_writer(PREFILL, [], count)
        assert got == list(range(count))
        assert self.call_writer(PREFILL, got, 0) == []
        assert self.full == set(got)

    # -- the model of each script -----------------------------------------------------------------------------
    def fresh_sample(self) -> int:
        self.next_sample += 1
        return self.next_sample

    def to_empty(self, slot: int, consumed: bool) -> None:
        if consumed:
            sample = self.sample[slot]
            assert sample is not None
            self.gone.add(sample)
        self.sample[slot] = None
        self.empty.append(slot)

    def model_writer(self, proc: str, count: int, first: int | None, want: int) -> tuple[bool, list[int]]:
        """WRITER_CYCLE: whether it committed, and the reply (the whole lease, topped up from empty's head)."""
        lease = self.lease[proc]
        committed = count > 0 and bool(lease) and lease[0] == first
        if committed:
            event(f"writer commits {count} of {len(lease)}")
            for s in lease[:count]:
                self.full.add(s)
                self.sample[s] = self.fresh_sample()
            del lease[:count]
        if len(lease) < want:
            taken = self.empty[: want - len(lease)]
            del self.empty[: len(taken)]
            lease.extend(taken)
        return committed, list(lease)

    def model_reader(self, proc: str, first: int | None, want: int, min_full: int, reply: list[int]) -> bool:
        """READER_CYCLE, checking ``reply`` against it; returns whether it committed the lease."""
        lease = self.lease[proc]
        committed = first is not None and bool(lease) and lease[0] == first
        if committed:
            event("reader returns its batch" + (" (some evicted meanwhile)" if self.pending & set(lease) else ""))
            for s in lease:
                if self.evict_on_read:
                    self.to_empty(s, consumed=True)
                elif s in self.pending:
                    self.to_empty(s, consumed=True)  # evicted while being read: now it goes
                else:
                    self.full.add(s)  # kept for later readers, same sample
            self.pending -= set(lease)
            self.reading -= set(lease)
            lease.clear()
        if lease:
            assert reply == lease, "a batch still leased must be handed out again, and nothing else"
        elif want == 0 or len(self.full) < min_full:
            assert reply == [], "no batch below the mixing threshold or when none is wanted"
        else:
            assert set(reply) <= self.full, f"reader got {set(reply) - self.full}, which were not full"
            assert len(reply) == min(want, len(self.full))
            event("reader gets a batch" if len(reply) == want else "reader gets a short batch")
            for s in reply:
                assert self.sample[s] is not None, f"slot {s} was handed to a reader without a sample"
                assert self.sample[s] not in self.gone, f"sample {self.sample[s]} reached a reader twice"
            self.full -= set(reply)
            lease.extend(reply)  # SPOP's order: the model follows it from here
            if not self.evict_on_read:
                self.reading |= set(reply)
        return committed

    # -- calls: Redis and the model in lockstep, Redis checked after each --------------------------------------
    def call_writer(self, proc: str, written: list[int], want: int) -> list[int]:
        reply = as_list(self.store.writer_cycle(proc, arr(written), want))
        _committed, expected = self.model_writer(proc, len(written), written[0] if written else None, want)
        assert reply == expected
        self.check_redis()
        return reply

    def call_reader(self, proc: str, done: list[int], want: int, min_full: int) -> tuple[bool, list[int]]:
        reply = as_list(self.store.reader_cycle(proc, arr(done), want, min_full, self.evict_on_read))
        committed = self.model_reader(proc, done[0] if done else None, want, min_full, reply)
        self.check_redis()
        return committed, reply

    # -- rules ------------------------------------------------------------------------------------------------
    # Draws never depend on what Redis chose: which slots a reader holds, and in which order, comes from SPOP,
    # which is random on the server, and Hypothesis needs the same draws when it replays an example. They are
    # read as "how many of the lease" or "a slot id" and applied to the model.
    @rule(
        writer=st.sampled_from(WRITERS),
        write=st.integers(0, 4),
        want=st.integers(0, 4),
        bogus=BOGUS,
        retry=st.booleans(),
    )
    def writer_cycle(self, writer: str, write: int, want: int, bogus: int | None, retry: bool) -> None:
        lease = list(self.lease[writer])
        written = lease[: min(write, len(lease))]  # a writer fills its lease from the head
        confused = bogus is not None and (not lease or bogus != lease[0])
        if confused:
            # A report whose first slot is not the lease head (a full, empty or someone else's slot, or anything
            # while the lease is empty): it must commit nothing.
            written = [bogus, *lease[1 : max(len(written), 1)]]
        full_before, empty_before = set(self.full), list(self.empty)
        got = self.call_writer(writer, written, want)
        if confused:
            assert self.full == full_before
        else:
            assert self.full == full_before | set(written)
            assert got[: len(lease) - len(written)] == lease[len(written) :], "the unwritten rest stays at the head"
            assert got[len(lease) - len(written) :] == empty_before[: len(got) - len(lease) + len(written)]
            assert len(got) == max(len(lease) - len(written), min(want, len(lease) - len(written) + len(empty_before)))
        if retry:  # the reply was lost and redis-py sent the same call again
            full_mid = set(self.full)
            again = self.call_writer(writer, written, want)
            event(
                "writer retry"
                + (" of a confused report" if confused else "")
                + (" returns another lease" if again != got else "")
            )
            if again != got or self.full != full_mid:
                # A confused report that matched nothing can match on the retry, and only one way: the first call
                # topped up an empty lease from empty's head, and that head was the reported slot.
                assert confused and not lease and got[0] == bogus

    @rule(
        reader=st.sampled_from(READERS),
        give_back=st.sampled_from([True, True, False]),  # a reader returns its batch, but not after a lost reply
        want=st.sampled_from([0, 1, BS]),
        min_full=st.sampled_from([0, 1, BS, 2 * BS, SLOTS - BS, SLOTS]),
        bogus=BOGUS,
        retry=st.booleans(),
    )
    def reader_cycle(
        self, reader: str, give_back: bool, want: int, min_full: int, bogus: int | None, retry: bool
    ) -> None:
        lease = list(self.lease[reader])
        done = lease if give_back else []  # its whole batch, or nothing (the reply that handed it out was lost)
        confused = bogus is not None and (not lease or bogus != lease[0])
        if confused:
            done = [bogus, *lease[1:]]
        full_before, empty_before = set(self.full), list(self.empty)
        committed, got = self.call_reader(reader, done, want, min_full)
        assert committed == (bool(done) and not confused)
        if not committed:
            assert self.full <= full_before and self.empty == empty_before, "a report that commits nothing"
            if lease:
                assert got == lease, "a lease left over is handed back"
        if retry:  # the reply was lost: the reader only ever sees the retry's
            committed_again, again = self.call_reader(reader, done, want, min_full)
            event(
                "reader retry"
                + (" of a confused report" if confused else "")
                + (" commits again" if committed_again else "")
            )
            if not committed_again:
                assert again == got, "a retried reader cycle must return the same batch"
            else:
                # The retry found the reported slot at the head of its lease again: the first call handed out a new
                # batch whose first slot SPOP drew as the reported one. That takes a confused report, or
                # evict_on_read=False (the returned batch went back to full, so SPOP may draw its first slot first
                # again). The retry then returns that unseen batch, which the model followed slot by slot, and
                # hands out another: a different reply, but no slot lost or doubled and no sample consumed unread
                # without a confused report. (NOTE [ Slot states ] says a retry returns the same slots.)
                assert got and got[0] == done[0]
                assert confused or not self.evict_on_read

    @rule(
        victims=st.lists(st.integers(0, SLOTS - 1), unique=True, max_size=BS + 1),
        reader=st.sampled_from(READERS),
        nth=st.none() | st.integers(0, BS - 1),
    )
    def evict(self, victims: list[int], reader: str, nth: int | None) -> None:
        # Also the nth slot a reader holds, if any: evicting a slot while it is being read is otherwise rare.
        batch = self.lease[reader]
        if nth is not None and nth < len(batch) and batch[nth] not in victims:
            victims = [*victims, batch[nth]]
        # Loader.evict sends unique ids; their order is the order full ones reach empty's tail.
        now = [s for s in victims if s in self.full]
        later = {s for s in victims if s in self.reading}
        assert self.store.evict(arr(victims)) == len(now) + len(later)
        for s in now:
            self.full.discard(s)
            self.to_empty(s, consumed=True)
        self.pending |= later
        self.check_redis()

    @rule(proc=st.sampled_from(WRITERS + READERS))
    def reclaim(self, proc: str) -> None:
        role = "writer" if proc in WRITERS else "reader"
        held = self.lease[proc]
        assert self.store.reclaim(proc, role) == len(held)
        if held:
            event(f"reclaim a {role}'s lease" + (" (some evicted meanwhile)" if self.pending & set(held) else ""))
        for s in held:
            if role == "writer":
                self.to_empty(s, consumed=False)  # torn rows: never published
            elif s in self.pending:
                self.to_empty(s, consumed=True)
            else:
                self.full.add(s)  # never delivered: back for another reader, same sample
        self.pending -= set(held)
        self.reading -= set(held)
        held.clear()
        self.check_redis()

    # -- checks -----------------------------------------------------------------------------------------------
    def check_redis(self) -> None:
        lists = [KEYS.empty, *(KEYS.lease(p) for p in PROCS)]
        sets = [KEYS.full, KEYS.reading, KEYS.evict_pending]
        pipe = self.client.pipeline(transaction=False)
        for key in lists:
            pipe.type(key)
            pipe.lrange(key, 0, -1)
        for key in sets:
            pipe.type(key)
            pipe.smembers(key)
        replies = pipe.execute()
        found: dict[str, list[int]] = {}
        for i, key in enumerate(lists + sets):
            kind, members = replies[2 * i], replies[2 * i + 1]
            assert kind in (b"none", b"list" if key in lists else b"set"), f"{key} is a {kind!r}"
            found[key] = [int(m) for m in members]
        empty, full = found[KEYS.empty], set(found[KEYS.full])
        leases = {p: found[KEYS.lease(p)] for p in PROCS}

        # Every slot in exactly one place, straight from Redis: nothing lost, nothing listed twice.
        places = Counter([*empty, *full, *(s for p in PROCS for s in leases[p])])
        assert set(places) == set(range(SLOTS)), f"lost slots: {set(range(SLOTS)) - set(places)}"
        assert all(n == 1 for n in places.values()), f"slots in two places: {[s for s, n in places.items() if n > 1]}"

        # And exactly where the model says, in the model's order.
        assert empty == self.empty
        assert full == self.full
        for p in PROCS:
            assert leases[p] == self.lease[p], p
        assert set(found[KEYS.reading]) == self.reading
        assert set(found[KEYS.evict_pending]) == self.pending
        leased_to_readers = {s for r in READERS for s in leases[r]}
        assert self.pending <= self.reading <= leased_to_readers
        if self.evict_on_read:
            assert self.reading == set()

    @invariant()
    def stats_add_up(self) -> None:
        gen, full, empty, _procs = self.store.stats()
        assert gen == GEN.encode()
        in_flight = sum(len(held) for held in self.lease.values())
        assert (full, empty) == (len(self.full), len(self.empty))
        assert full + empty + in_flight == SLOTS

    @invariant()
    def full_slots_hold_live_samples(self) -> None:
        for s in self.full:
            assert self.sample[s] is not None
            assert self.sample[s] not in self.gone
        for s in self.empty:
            assert self.sample[s] is None
        for p in WRITERS:
            for s in self.lease[p]:
                assert self.sample[s] is None, "a writer's slot holds nothing published"


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    c = connect(redis_url, total_timeout_s=5.0)
    yield c
    c.close()


@pytest.mark.parametrize("evict_on_read", [True, False], ids=["evict_on_read", "keep_on_read"])
def test_slot_state_machine(client: Client, evict_on_read: bool) -> None:
    run_state_machine_as_test(lambda: SlotMachine(client, evict_on_read), settings=SETTINGS)
