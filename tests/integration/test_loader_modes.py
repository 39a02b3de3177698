"""The loader's modes: re-sampling with explicit eviction, one ordered pass (fill_once), the dummy batch, buffer
statistics, and several loaders sharing one Redis."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch
from datasets import (
    DEADLINE_S,
    SlowUniqueIds,
    UniqueIds,
    check_unique_batch,
    counter_of,
    take,
    wait_for,
)
from slot_audit import audit_slots

from gigashuffle import (
    INDEX_KEY,
    DataloaderConfig,
    MultiprocessShuffledDataloader,
    QueueInUseError,
    ShuffleBufferStats,
)
from gigashuffle.control.keys import QueueKeys


def _queue(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


# -- evict_on_read=False ---------------------------------------------------------------------------------------


def test_without_evict_on_read_slots_are_resampled_until_evicted(redis_url: str) -> None:
    bs, slots = 8, 64
    cfg = DataloaderConfig(
        bs=bs, shuffle_size=slots, queue_name=_queue("resample"), num_writers=1, num_readers=1,
        evict_on_read=False, redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        it = iter(loader)
        seen: list[int] = []
        last = None
        for batch in take(it, 40):  # 320 reads of a 64-slot buffer
            seen.extend(check_unique_batch(batch, bs, slots))
            last = batch
        assert len(set(seen)) <= slots, "without evictions each slot is written once"
        assert len(seen) > len(set(seen)), "slots are sampled again"
        stats = wait_for(lambda: s if (s := loader.stats()).full + s.in_flight == slots else None, "a full buffer")
        assert stats.empty == 0, "nothing is evicted before evict()"
        assert last is not None
        old = set(seen)

        evicted_index = last[0][INDEX_KEY].clone()
        assert loader.evict(evicted_index) == bs
        # The only writer filled the buffer once, with counters 0..slots-1, and then wrote nothing more.
        assert all(i < slots for i in counter_of(np.array(sorted(old))))
        # The evicted slots are written again with the writer's next rows, which then show up.
        deadline = time.monotonic() + DEADLINE_S
        new: set[int] = set()
        while not new:
            assert time.monotonic() < deadline, "no new rows after evict()"
            for batch in take(it, 1):
                new.update(i for i in check_unique_batch(batch, bs, slots) if counter_of(i) >= slots)
        assert not new & old
        # Later batches hold at most bs new rows: only the evicted slots were refilled.
        for batch in take(it, 20):
            new.update(i for i in check_unique_batch(batch, bs, slots) if counter_of(i) >= slots)
        assert len(new) <= bs
        # A tensor, an ndarray, a list and an empty selection are all accepted.
        assert loader.evict(np.array([], dtype=np.int64)) == 0
        assert loader.evict(np.asarray(evicted_index[:2]).astype(np.int32)) in (0, 1, 2)
        assert loader.evict([0]) in (0, 1)


def test_evict_rejects_bad_input(redis_url: str) -> None:
    cfg = DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=_queue("badevict"), num_writers=1, num_readers=1, evict_on_read=False,
        redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        for bad in (torch.tensor([64]), torch.tensor([-1]), torch.tensor([0.5]), np.array([1.0, 2.0]), [0, 1000]):
            with pytest.raises(ValueError, match="evict"):
                loader.evict(bad)
        take(iter(loader), 2)  # still healthy


def test_evict_with_evict_on_read_raises(redis_url: str) -> None:
    cfg = DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=_queue("evictread"), num_writers=1, num_readers=1, redis_url=redis_url
    )
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        batch = take(iter(loader), 1)[0]
        with pytest.raises(ValueError, match="evict_on_read"):
            loader.evict(batch[0][INDEX_KEY])


# -- fill_once -------------------------------------------------------------------------------------------------


def _fill_once_config(redis_url: str, queue: str, **overrides: object) -> DataloaderConfig:
    settings: dict[str, object] = dict(
        bs=8, shuffle_size=68, queue_name=queue, num_writers=2, num_readers=1, fill_once=True, min_mixing=1.0,
        redis_url=redis_url,
    )  # fmt: skip
    settings.update(overrides)
    return DataloaderConfig(**settings)  # type: ignore[arg-type]


def _one_pass(loader: MultiprocessShuffledDataloader) -> list[tuple[list[int], list[int]]]:
    """(ids, slot indices) of every batch of one pass."""
    deadline = time.monotonic() + DEADLINE_S
    out = []
    for batch in loader:
        assert time.monotonic() < deadline, "the pass did not end"
        cfg = loader.config
        out.append((check_unique_batch(batch, cfg.bs, cfg.shuffle_size), batch[0][INDEX_KEY].tolist()))
    return out


def test_fill_once_yields_one_ordered_pass_again_and_again(redis_url: str) -> None:
    cfg = _fill_once_config(redis_url, _queue("fill"))
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        first = _one_pass(loader)
        # 68 // 8 = 8 batches (the last 4 slots never make a batch), in slot order.
        assert len(first) == 68 // 8
        for b, row in enumerate(first):
            assert row[1] == list(range(b * 8, (b + 1) * 8))
        ids = [i for row in first for i in row[0]]
        assert len(set(ids)) == len(ids) == 64
        assert loader.stats() == ShuffleBufferStats(full=68, empty=0, in_flight=0)
        # Every later pass replays the same buffer: same ids, same order.
        assert _one_pass(loader) == first
        assert _one_pass(loader) == first


def test_fill_once_abandoned_pass_restarts_at_the_first_batch(redis_url: str) -> None:
    cfg = _fill_once_config(redis_url, _queue("abandon"), num_writers=1)
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        full = _one_pass(loader)
        it = iter(loader)
        partial = [check_unique_batch(b, 8, 68) for b in take(it, 3)]
        assert partial == [row[0] for row in full[:3]]
        del it
        assert _one_pass(loader) == full
        with pytest.raises(StopIteration):
            it2 = iter(loader)
            for _ in range(100):
                next(it2)


def test_get_dummy_batch_copies_the_first_row_and_consumes_nothing(redis_url: str) -> None:
    bs = 8
    # One writer: the dummy row is writer 0's first row, and with a second writer racing for the 64 slots of a
    # fill_once buffer (writes go to shared memory at once) writer 0's first chunk need not be among them.
    cfg = _fill_once_config(redis_url, _queue("dummy"), bs=bs, shuffle_size=64, num_writers=1)
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        dummy = loader.get_dummy_batch()
        again = loader.get_dummy_batch()
        assert len(dummy) == 1 and set(dummy[0]) == {"id", "x", "y", INDEX_KEY}
        assert torch.equal(dummy[0][INDEX_KEY], torch.full((bs,), -1, dtype=torch.int64))
        first_id = int(dummy[0]["id"][0])
        assert torch.equal(dummy[0]["id"], torch.full((bs,), first_id, dtype=torch.int64))
        assert counter_of(first_id) == 0, "the first row of some writer's first chunk"
        assert torch.equal(dummy[0]["x"], torch.full((bs, 3), first_id, dtype=torch.int64))
        assert torch.equal(dummy[0]["y"], torch.full((bs,), -first_id, dtype=torch.float64))
        for key in dummy[0]:
            assert torch.equal(dummy[0][key], again[0][key])
        # The dummy is the caller's own memory: scribbling on it changes nothing in the loader.
        dummy[0]["id"].fill_(-5)
        # The whole pass is still there, starting with its first batch.
        passed = _one_pass(loader)
        assert len(passed) == 64 // bs
        assert passed[0][1] == list(range(bs))
        ids = [i for row in passed for i in row[0]]
        assert len(set(ids)) == 64 and first_id in ids
        real = loader.get_dummy_batch()
        assert int(real[0]["id"][0]) == first_id


def test_dummy_batch_in_streaming_mode_matches_real_batches(redis_url: str) -> None:
    bs = 4
    cfg = DataloaderConfig(
        bs=bs, shuffle_size=64, queue_name=_queue("dummy2"), num_writers=1, num_readers=1, redis_url=redis_url
    )
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        dummy = loader.get_dummy_batch()
        assert int(dummy[0]["id"][0]) == 0  # the only writer is worker 0; its first row has id 0
        seen: set[int] = set()
        for batch in take(iter(loader), 40):
            ids = check_unique_batch(batch, bs, 64)
            assert not seen.intersection(ids)
            seen.update(ids)
            for key in dummy[0]:
                assert dummy[0][key].dtype == batch[0][key].dtype and dummy[0][key].shape == batch[0][key].shape


# -- stats -----------------------------------------------------------------------------------------------------


def test_stats_account_for_every_slot(redis_url: str) -> None:
    slots = 64
    cfg = DataloaderConfig(
        bs=4,
        shuffle_size=slots,
        queue_name=_queue("stats"),
        num_writers=1,
        num_readers=1,
        ring_depth=4,
        redis_url=redis_url,
    )
    with MultiprocessShuffledDataloader(SlowUniqueIds(chunk=4, sleep_s=0.02), cfg) as loader:
        early = loader.stats()
        assert isinstance(early, ShuffleBufferStats)
        # Before the first chunk has sized the buffer, all zeros; after, every slot is accounted for.
        assert early == ShuffleBufferStats(0, 0, 0) or early.full + early.empty + early.in_flight == slots
        it = iter(loader)
        for _ in range(20):
            take(it, 1)
            s = loader.stats()
            assert min(s.full, s.empty, s.in_flight) >= 0
            assert s.full + s.empty + s.in_flight == slots
            assert s.full <= slots and s.in_flight <= slots
        # Leave the buffer alone: the writer fills it up (the reader holds at most ring_depth batches).
        full = wait_for(lambda: s if (s := loader.stats()).full >= slots - 4 * cfg.bs else None, "a full buffer")
        assert full.full + full.empty + full.in_flight == slots
        # Quiet now (no empty slot for the writer, a full ring for the reader): stats() must agree exactly with an
        # independent, atomic count of where every slot is, taken before and after it.
        keys = QueueKeys(cfg.queue_name, cfg.node)

        def quiet_and_counted() -> tuple[ShuffleBufferStats, dict[str, int]] | None:
            first = audit_slots(redis_url, keys, slots)
            stats = loader.stats()
            return (stats, first) if audit_slots(redis_url, keys, slots) == first else None

        stats, audit = wait_for(quiet_and_counted, "two equal slot audits around stats()")
        assert (stats.full, stats.empty, stats.in_flight) == (audit["full"], audit["empty"], audit["leased"]), audit


# -- several loaders -------------------------------------------------------------------------------------------


def test_loaders_with_different_queues_do_not_interfere(redis_url: str) -> None:
    bases = (0, 10**12, 2 * 10**12)
    loaders = []
    try:
        for k, base in enumerate(bases):
            cfg = DataloaderConfig(
                bs=4, shuffle_size=64, queue_name=_queue(f"multi{k}"), num_writers=1, num_readers=1,
                redis_url=redis_url,
            )  # fmt: skip
            loaders.append(MultiprocessShuffledDataloader(UniqueIds(chunk=8, base=base), cfg))
        iterators = [iter(loader) for loader in loaders]
        seen: list[set[int]] = [set() for _ in bases]
        for _round in range(15):
            for k, it in enumerate(iterators):
                ids = check_unique_batch(take(it, 1)[0], 4, 64)
                assert all(bases[k] <= i < bases[k] + 10**12 for i in ids), f"loader {k} got another's rows: {ids}"
                assert not seen[k].intersection(ids)
                seen[k].update(ids)
        # Closing one leaves the others running.
        loaders[1].close()
        for k in (0, 2):
            ids = check_unique_batch(take(iterators[k], 1)[0], 4, 64)
            assert all(bases[k] <= i < bases[k] + 10**12 for i in ids)
        with pytest.raises(Exception, match="closed"):
            next(iterators[1])
    finally:
        for loader in loaders:
            loader.close()


def test_same_queue_and_rank_twice_is_refused(redis_url: str) -> None:
    queue = _queue("inuse")
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=queue, num_writers=1, num_readers=1, redis_url=redis_url)
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as loader:
        it = iter(loader)
        take(it, 1)
        with pytest.raises(QueueInUseError, match=queue):
            MultiprocessShuffledDataloader(UniqueIds(), cfg)
        check_unique_batch(take(it, 1)[0], 4, 64)  # the first loader is unharmed
    # Once the first one is closed, the queue is free again.
    with MultiprocessShuffledDataloader(UniqueIds(), cfg) as again:
        check_unique_batch(take(iter(again), 1)[0], 4, 64)
