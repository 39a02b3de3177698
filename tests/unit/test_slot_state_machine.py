"""Random sequences of slot transitions against a real Redis, checked against a model after every step.

The model mirrors where each slot is (empty, full, or one process's lease) and which sample each slot holds:
a writer that publishes a slot gives it a fresh sample id, and a sample that was read with evict_on_read=True
or evicted must never reach a reader again. See NOTE [ Slot states ] in gigashuffle/scripts.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
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
WRITERS = ("w0", "w1")
READERS = ("r0", "r1", "r2")
GEN = "machine-gen"
KEYS = QueueKeys("machine", "n0")
EMPTY = "empty"
FULL = "full"

SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def arr(slots: set[int]) -> np.ndarray:
    return np.array(sorted(slots), dtype=np.int32)


def as_set(reply: np.ndarray) -> set[int]:
    values = reply.tolist()
    assert len(values) == len(set(values)), f"a reply named a slot twice: {values}"
    return set(values)


class SlotMachine(RuleBasedStateMachine):
    def __init__(self, client: Client, evict_on_read: bool) -> None:
        super().__init__()
        self.client = client
        self.evict_on_read = evict_on_read
        client.flushdb()  # this worker's private server; every example starts from a fresh session
        client.set(KEYS.gen, GEN)
        self.store = SlotStore(client, KEYS, generation=GEN)
        assert self.store.seed(SLOTS, {"layout": "{}", "slots": str(SLOTS)})
        self.loc: dict[int, str] = dict.fromkeys(range(SLOTS), EMPTY)
        self.sample: dict[int, int | None] = dict.fromkeys(range(SLOTS))
        self.next_sample = 0
        self.reading: set[int] = set()  # slots leased to readers, tracked by Redis only without evict_on_read
        self.pending: set[int] = set()  # evicted while being read
        self.gone: set[int] = set()  # samples consumed or evicted: never to be handed to a reader again

    @initialize(count=st.integers(0, SLOTS))
    def prefill(self, count: int) -> None:
        """Start most examples with full slots, so that readers get batches within a few steps."""
        got = as_set(self.store.writer_cycle("w-init", arr(set()), count))
        assert len(got) == count
        assert len(self.store.writer_cycle("w-init", arr(got), 0)) == 0
        for s in got:
            self.sample[s] = self.fresh_sample()
            self.loc[s] = FULL

    # -- model helpers ----------------------------------------------------------------------------------------
    def where(self, place: str) -> set[int]:
        return {s for s, at in self.loc.items() if at == place}

    def fresh_sample(self) -> int:
        self.next_sample += 1
        return self.next_sample

    def to_empty(self, slot: int, consumed: bool) -> None:
        if consumed:
            sample = self.sample[slot]
            assert sample is not None
            self.gone.add(sample)
        self.sample[slot] = None
        self.loc[slot] = EMPTY

    # -- rules ------------------------------------------------------------------------------------------------
    # Draws never depend on the model: which slots a process holds comes from SPOP, which is random on the
    # server, and Hypothesis needs the same draws when it replays an example.
    @rule(
        writer=st.sampled_from(WRITERS),
        write=st.integers(0, 4),
        want=st.integers(0, 4),
        bogus=st.sets(st.integers(0, SLOTS - 1), max_size=2),
        retry=st.booleans(),
    )
    def writer_cycle(self, writer: str, write: int, want: int, bogus: set[int], retry: bool) -> None:
        held = self.where(writer)
        written = set(sorted(held)[:write])
        empty_before = self.where(EMPTY)
        # A confused writer may also report full slots or slots another process holds: they must not move. (Not
        # empty slots: the call may lease them to this writer, and a retry would then rightly publish them.)
        claimed = written | (bogus - held - empty_before)
        reply = self.store.writer_cycle(writer, arr(claimed), want)
        got = as_set(reply)
        if retry:  # the reply was lost and redis-py sent the same call again
            assert as_set(self.store.writer_cycle(writer, arr(claimed), want)) == got
        for s in written:
            self.sample[s] = self.fresh_sample()
            self.loc[s] = FULL
        remaining = held - written
        if len(remaining) >= want:
            assert got == remaining
            return
        new = got - remaining
        assert remaining <= got
        assert new <= empty_before, f"writer got {new - empty_before}, which were not empty"
        assert len(new) == min(want - len(remaining), len(empty_before))
        for s in new:
            self.loc[s] = writer

    @rule(
        reader=st.sampled_from(READERS),
        give_back=st.booleans(),
        want=st.sampled_from([0, BS]),
        min_full=st.sampled_from([0, 1, BS, 2 * BS, SLOTS - BS, SLOTS]),
        retry=st.booleans(),
    )
    def reader_cycle(self, reader: str, give_back: bool, want: int, min_full: int, retry: bool) -> None:
        held = self.where(reader)
        done = held if give_back else set()
        reply = self.store.reader_cycle(reader, arr(done), want, min_full, self.evict_on_read)
        got = as_set(reply)
        if retry:  # the reply was lost: the reader only ever sees the retry's
            again = as_set(self.store.reader_cycle(reader, arr(done), want, min_full, self.evict_on_read))
            if got & done:
                # Only without evict_on_read can a new batch re-pick slots the same call returned; the retry returns
                # those again and tops up, so the batch differs but stays whole.
                assert not self.evict_on_read
                assert len(again) == len(got)
            else:
                assert again == got
            got = again
        for s in done:
            if self.evict_on_read or s in self.pending:
                self.to_empty(s, consumed=True)
            else:
                self.loc[s] = FULL
            self.pending.discard(s)
            self.reading.discard(s)
        rest = held - done
        full_now = self.where(FULL)
        if rest:
            assert got == rest  # a batch still leased is handed out again, never a second one
        elif want == 0 or len(full_now) < min_full:
            assert got == set()
        else:
            assert got <= full_now, f"reader got {got - full_now}, which were not full"
            assert len(got) == min(want, len(full_now))
            for s in got:
                assert self.sample[s] is not None, f"slot {s} was handed to a reader without a sample"
                assert self.sample[s] not in self.gone, f"sample {self.sample[s]} reached a reader twice"
                self.loc[s] = reader
                if not self.evict_on_read:
                    self.reading.add(s)

    @rule(victims=st.sets(st.integers(0, SLOTS - 1), max_size=SLOTS))
    def evict(self, victims: set[int]) -> None:
        now = victims & self.where(FULL)
        later = victims & self.reading
        assert self.store.evict(arr(victims)) == len(now) + len(later)
        for s in now:
            self.to_empty(s, consumed=True)
        self.pending |= later

    @rule(proc=st.sampled_from(WRITERS + READERS))
    def reclaim(self, proc: str) -> None:
        role = "writer" if proc in WRITERS else "reader"
        held = self.where(proc)
        assert self.store.reclaim(proc, role) == len(held)
        for s in held:
            if role == "writer":
                self.to_empty(s, consumed=False)  # torn rows: never published
            elif s in self.pending:
                self.to_empty(s, consumed=True)
            else:
                self.loc[s] = FULL
            self.pending.discard(s)
            self.reading.discard(s)

    # -- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def every_slot_is_in_exactly_one_place(self) -> None:
        procs = WRITERS + READERS
        names = [EMPTY, FULL, "reading", "evict", *procs]
        pipe = self.client.pipeline(transaction=False)
        for key in (KEYS.empty, KEYS.full, KEYS.reading, KEYS.evict_pending, *(KEYS.lease(p) for p in procs)):
            pipe.smembers(key)
        found = {name: {int(m) for m in members} for name, members in zip(names, pipe.execute(), strict=True)}

        places = Counter(s for name in (EMPTY, FULL, *procs) for s in found[name])
        assert set(places) == set(range(SLOTS)), f"lost slots: {set(range(SLOTS)) - set(places)}"
        assert all(n == 1 for n in places.values()), f"slots in two places: {[s for s, n in places.items() if n > 1]}"
        for name in (EMPTY, FULL, *procs):
            assert found[name] == self.where(name), name
        assert found["reading"] == self.reading
        assert found["evict"] == self.pending
        leased_to_readers = set().union(*(found[r] for r in READERS))
        assert found["evict"] <= found["reading"] <= leased_to_readers
        if self.evict_on_read:
            assert found["reading"] == set()

    @invariant()
    def stats_add_up(self) -> None:
        gen, full, empty, _procs = self.store.stats()
        assert gen == GEN.encode()
        in_flight = sum(1 for at in self.loc.values() if at not in (EMPTY, FULL))
        assert (full, empty) == (len(self.where(FULL)), len(self.where(EMPTY)))
        assert full + empty + in_flight == SLOTS

    @invariant()
    def full_slots_hold_live_samples(self) -> None:
        for s in self.where(FULL):
            assert self.sample[s] is not None
            assert self.sample[s] not in self.gone


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    c = connect(redis_url, total_timeout_s=5.0)
    yield c
    c.close()


@pytest.mark.parametrize("evict_on_read", [True, False], ids=["evict_on_read", "keep_on_read"])
def test_slot_state_machine(client: Client, evict_on_read: bool) -> None:
    run_state_machine_as_test(lambda: SlotMachine(client, evict_on_read), settings=SETTINGS)
