"""The core promise of the loader, with real processes and a real Redis: what a batch looks like, that every
sample is read once, that no row is torn, that held batches are never overwritten, and how the children are
named."""

from __future__ import annotations

import platform
import time
import uuid
from pathlib import Path

import pytest
import torch
from datasets import (
    ID_STRIDE,
    FiniteUniqueIds,
    UniqueIds,
    check_unique_batch,
    counter_of,
    take,
    wait_for,
    writer_of,
)

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader


def _queue(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def test_batches_are_lists_of_dicts_shaped_like_the_chunks(redis_url: str) -> None:
    cfg = DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=_queue("shape"), num_writers=1, num_readers=1, redis_url=redis_url
    )
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        batches = take(iter(loader), 20)
        for batch in batches:
            check_unique_batch(batch, bs=4, shuffle_size=64)
            index = batch[0][INDEX_KEY]
            assert len(set(index.tolist())) == 4, "a batch holds distinct slots"
            assert all(isinstance(t, torch.Tensor) for t in batch[0].values())


def test_each_sample_is_read_once_and_no_row_is_torn(redis_url: str) -> None:
    bs, slots = 16, 128
    cfg = DataloaderConfig(
        bs=bs, shuffle_size=slots, queue_name=_queue("once"), num_writers=2, num_readers=2, redis_url=redis_url
    )
    seen: set[int] = set()
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        for batch in take(iter(loader), 200):  # 3200 rows, 25x the buffer
            ids = check_unique_batch(batch, bs, slots)
            repeated = seen.intersection(ids)
            assert not repeated, f"ids read twice: {sorted(repeated)[:10]}"
            assert len(set(ids)) == bs
            seen.update(ids)
    assert len(seen) == 200 * bs
    # Both writers contributed, and each writer's ids are its own counters (get_worker_info().id 0 and 1).
    assert {int(writer_of(i)) for i in seen} <= {0, 1}
    assert all(counter_of(i) < ID_STRIDE for i in seen)


@pytest.mark.parametrize("num_readers", [1, 2])
def test_every_row_written_is_delivered_exactly_once(redis_url: str, num_readers: int) -> None:
    """Nothing lost, nothing doubled: two writers write a known, finite set of rows (11x the buffer); reading
    until that many rows came must yield exactly that set."""
    bs, slots, per_writer = 16, 96, 528  # 1056 rows = 66 batches
    cfg = DataloaderConfig(
        bs=bs,
        shuffle_size=slots,
        queue_name=_queue("lossless"),
        num_writers=2,
        num_readers=num_readers,
        min_mixing=0.0,  # read down to the last bs rows: the tail of a finite set must come out too
        redis_url=redis_url,
    )
    written = {w * ID_STRIDE + c for w in (0, 1) for c in range(per_writer)}
    delivered: list[int] = []
    with MultiprocessShuffledDataloader(FiniteUniqueIds(per_writer, chunk=8), cfg) as loader:
        for batch in take(iter(loader), len(written) // bs):
            delivered.extend(check_unique_batch(batch, bs, slots))
        stats = loader.stats()
    doubled = len(delivered) - len(set(delivered))
    lost = sorted(written - set(delivered))
    stray = sorted(set(delivered) - written)
    assert (doubled, lost[:10], stray[:10]) == (0, [], []), f"{doubled} doubled, {len(lost)} lost, {len(stray)} stray"
    assert stats.full == 0, stats  # every written row left the buffer


def test_held_batches_are_never_overwritten(redis_url: str) -> None:
    """Holding far more batches than the ring has slots: the caller gets copies, never a reused ring slot."""
    bs, depth = 4, 2
    cfg = DataloaderConfig(
        bs=bs,
        shuffle_size=64,
        queue_name=_queue("held"),
        num_writers=1,
        num_readers=2,
        ring_depth=depth,
        redis_url=redis_url,
    )
    held: list[tuple[list[dict[str, torch.Tensor]], torch.Tensor, torch.Tensor]] = []
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        it = iter(loader)
        for batch in take(it, 12):  # 12 > readers * ring_depth = 4
            check_unique_batch(batch, bs, 64)
            held.append((batch, batch[0]["id"].clone(), batch[0][INDEX_KEY].clone()))
        # Keep iterating while holding them: readers keep gathering into their rings meanwhile.
        for batch in take(it, 30):
            check_unique_batch(batch, bs, 64)
        for batch, ids, index in held:
            assert torch.equal(batch[0]["id"], ids), "a held batch was overwritten"
            assert torch.equal(batch[0][INDEX_KEY], index), "a held batch's index was overwritten"
            check_unique_batch(batch, bs, 64)
        all_ids = torch.cat([ids for _, ids, _ in held]).tolist()
        assert len(set(all_ids)) == len(all_ids)
    # The views stay readable after close(): the mapping lives as long as a tensor uses it.
    for batch, ids, _ in held:
        assert torch.equal(batch[0]["id"], ids)


def test_released_batches_let_the_loader_run_on(redis_url: str) -> None:
    """Dropping each batch at once recycles ring slots: a long run with a tiny ring never stalls."""
    cfg = DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=_queue("drop"), num_writers=1, num_readers=1, ring_depth=2,
        redis_url=redis_url,
    )  # fmt: skip
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        it = iter(loader)
        seen: set[int] = set()
        for _ in range(150):
            ids = check_unique_batch(take(it, 1)[0], 4, 64)
            assert not seen.intersection(ids)
            seen.update(ids)


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def test_children_have_descriptive_process_titles(redis_url: str) -> None:
    pytest.importorskip("setproctitle")
    queue = _queue("titles")
    cfg = DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=queue, num_writers=2, num_readers=2, global_rank=0, redis_url=redis_url
    )
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        take(iter(loader), 2)  # the buffer is published: one writer is its owner
        loader.wait_started()
        pids = loader.child_pids()
        assert len(pids["writer"]) == 2 and len(pids["reader"]) == 2 and len(pids["zygote"]) == 1

        def titles() -> dict[str, list[str]]:
            return {role: sorted(_title(pid) for pid in found) for role, found in pids.items()}

        wait_for(lambda: any("owner" in t for t in titles()["writer"]), "the owner writer's title")
        found = titles()
        assert found["zygote"] == [f"gigashuffle zygote {queue} rank=0"]
        for role in ("writer", "reader"):
            for i, title in enumerate(found[role]):
                assert title.startswith(f"gigashuffle {role} {queue} rank=0 proc={i}"), found
        assert sum("owner" in t for t in found["writer"]) == 1, found
        assert not any("owner" in t for t in found["reader"]), found

        # The same processes are registered in Redis with their role and rank, and one of them as the owner.
        # (A writer that lost the race to publish the buffer is registered as owner until it has attached.)
        def settled() -> dict[str, dict[str, object]] | None:
            found = loader.processes()
            pids_found = {info["pid"] for info in found.values()}
            if not set(pids["writer"] + pids["reader"]) <= pids_found:
                return None  # a child that has not started its loop yet
            return found if sum(bool(info.get("owner")) for info in found.values()) == 1 else None

        registered = wait_for(settled, "every child registered, one of them as the owner")
        by_pid = {info["pid"]: info for info in registered.values()}
        for role in ("writer", "reader"):
            for pid in pids[role]:
                assert by_pid[pid]["role"] == role and by_pid[pid]["rank"] == 0
        owner = next(info for info in registered.values() if info.get("owner"))
        assert owner["role"] == "writer" and "owner" in _title(owner["pid"])


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


_OURS = "glibc.cpu.x86_non_temporal_threshold=65536"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="glibc's streaming-store threshold is x86-64 only")
@pytest.mark.parametrize(
    ("user_tunables", "expected"),
    [
        (None, _OURS),
        # (Added to other tunables too, but glibc cuts what /proc shows at the first ':': tests/unit/test_procs.py.)
        ("glibc.cpu.x86_non_temporal_threshold=1048576", "glibc.cpu.x86_non_temporal_threshold=1048576"),
    ],
)
def test_children_copy_large_rows_past_the_caches(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, user_tunables: str | None, expected: str
) -> None:
    """Writers and readers run with glibc's streaming-store threshold at 64 KB (see procs._streaming_copies),
    added to the user's GLIBC_TUNABLES, and never overriding a threshold the user chose."""
    if user_tunables is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", user_tunables)
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=_queue("tunables"), num_writers=1, num_readers=1,
                           redis_url=redis_url)  # fmt: skip
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        take(iter(loader), 2)
        pids = loader.child_pids()
        found = {_environ(pid).get("GLIBC_TUNABLES") for role in ("writer", "reader") for pid in pids[role]}
    assert found == {expected}, found


_READY_WITHIN_S = 60.0


@pytest.mark.parametrize(("configured", "expected"), [(None, 8), (3, 3)])
def test_the_trainer_maps_each_reader_ring_at_the_depth_the_reader_chose(
    redis_url: str, configured: int | None, expected: int
) -> None:
    """ring_depth=None gives small batches a ring of 8 (NOTE [ Ring depth ]); the depth travels with the ring's fd,
    and batches read through it are whole."""
    bs = 4
    cfg = DataloaderConfig(
        bs=bs, shuffle_size=64, queue_name=_queue("depth"), num_writers=1, num_readers=2, ring_depth=configured,
        redis_url=redis_url,
    )  # fmt: skip
    seen: set[int] = set()
    with MultiprocessShuffledDataloader(UniqueIds(chunk=8), cfg) as loader:
        batches = iter(loader)
        deadline = time.monotonic() + _READY_WITHIN_S
        # One reader may deliver many batches before the other has its ring mapped (a loaded machine starts it late).
        while len(seen) < 40 * bs or any(c.ring is None for c in loader._sup.readers()):
            assert time.monotonic() < deadline, f"no ring from some reader in {_READY_WITHIN_S} s"
            ids = check_unique_batch(next(batches), bs, 64)
            assert not seen.intersection(ids)
            seen.update(ids)
        rings = [c.ring for c in loader._sup.readers()]
        assert len(rings) == 2 and all(r is not None and r.depth == expected for r in rings), rings
