"""The node barrier of a checkpoint's cut (NOTE [ Node cut ] in control/cutbarrier.py), on a real Redis: who counts
as arrived, what a stale entry or another session cannot do, and a rank that never calls ``state_dict()``."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from datasets import Counter, take

from gigashuffle import CheckpointError, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.checkpoint import savedrows
from gigashuffle.control import cutbarrier
from gigashuffle.control.client import connect
from gigashuffle.control.cutbarrier import COPIED, LISTED, PAUSED, NodeBarrier
from gigashuffle.control.keys import QueueKeys
from gigashuffle.control.plane import ControlPlane


@pytest.fixture
def node(redis_url: str) -> Iterator[tuple[ControlPlane, str]]:
    """A node of three local ranks (global ranks 4, 5, 6) whose claims hold tokens t4, t5, t6."""
    client = connect(redis_url)
    store = ControlPlane(client, QueueKeys(f"cb-{uuid.uuid4().hex[:8]}", "n2"), "gen-a")
    for rank in (4, 5, 6):
        client.set(store.keys.rank(rank), f"t{rank}", px=60_000)
    yield store, redis_url
    client.close()


def _barrier(store: ControlPlane, local_rank: int, token: str | None = None) -> NodeBarrier:
    return NodeBarrier(store, store.keys.queue, 4 + local_rank, local_rank, 3, token or f"t{4 + local_rank}")


def test_a_barrier_opens_once_every_local_rank_arrived(node: tuple[ControlPlane, str]) -> None:
    store, _ = node
    ranks = [_barrier(store, i) for i in range(3)]
    assert set(ranks[0].arrive(1, PAUSED)) == {1, 2}
    assert set(ranks[2].arrive(1, PAUSED)) == {1}
    assert ranks[1].arrive(1, PAUSED) == {}
    assert ranks[0].arrive(1, PAUSED) == {}
    # Phase 2 needs every rank again; a rank already at the next cut counts as past it.
    assert set(ranks[0].arrive(1, COPIED)) == {1, 2}
    ranks[1].arrive(2, PAUSED)
    assert set(ranks[0].arrive(1, COPIED)) == {2}
    assert 0 < store.client.pttl(store.keys.cut("gen-a")) <= cutbarrier.TTL_MS


def test_an_entry_of_an_earlier_trainer_of_the_rank_does_not_count(node: tuple[ControlPlane, str]) -> None:
    """A job that died left '5 2 old' for local rank 1 in the same session; the rank's claim now holds t5."""
    store, _ = node
    _barrier(store, 1, token="old").arrive(5, COPIED)
    _barrier(store, 2).arrive(1, PAUSED)
    assert set(_barrier(store, 0).arrive(1, PAUSED)) == {1}
    store.client.delete(store.keys.rank(6))  # a rank whose trainer died and whose claim lapsed
    assert set(_barrier(store, 0).arrive(1, PAUSED)) == {1, 2}


def test_another_session_cannot_satisfy_a_barrier(node: tuple[ControlPlane, str]) -> None:
    store, _ = node
    for i in (1, 2):
        _barrier(store, i).arrive(1, COPIED)
    later = ControlPlane(store.client, store.keys, "gen-b")
    assert set(_barrier(later, 0).arrive(1, PAUSED)) == {1, 2}


def test_a_wait_past_its_deadline_names_the_missing_ranks(node: tuple[ControlPlane, str]) -> None:
    store, _ = node
    _barrier(store, 2).arrive(3, PAUSED)
    waits: list[float] = []
    with pytest.raises(CheckpointError, match=r"global rank 5 \(local rank 1: never took part.*global rank 6 "
                       r"\(local rank 2: last at cut 3 phase 1\)"):  # fmt: skip
        _barrier(store, 0).wait(3, COPIED, time.monotonic() + 0.2, waits.append, time.monotonic)
    assert waits and max(waits) <= 0.02, "the wait polls, and never for long"


def test_a_rank_that_never_calls_state_dict_fails_the_others_checkpoint(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of a node of two asks for a checkpoint that rank 1 never takes: a CheckpointError naming rank 1, not a
    hang; rank 0's loader reads on (its children were resumed)."""
    monkeypatch.setattr(cutbarrier, "WAIT_S", 1.0)
    with _node_of_two(redis_url) as (rank0, _rank1, it0, it1):
        with pytest.raises(CheckpointError, match=r"global rank 1 \(local rank 1: never took part in a cut\)"):
            rank0.state_dict()
        assert len(take(it0, 3)) == 3 and len(take(it1, 3)) == 3


@contextlib.contextmanager
def _node_of_two(redis_url: str) -> Iterator[tuple[Any, Any, Iterator[Any], Iterator[Any]]]:
    """Local ranks 0 and 1 of one node in this process (each reads two batches): the loaders and their iterators."""
    queue = f"cbn-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = dict(bs=4, shuffle_size=64, queue_name=queue, num_writers=1, num_readers=1,
                                  local_world_size=2, global_world_size=2, redis_url=redis_url)  # fmt: skip
    with (
        MultiprocessShuffledDataloader(Counter(), DataloaderConfig(**common)) as rank0,
        MultiprocessShuffledDataloader(Counter(), DataloaderConfig(local_rank=1, global_rank=1, **common)) as rank1,
    ):
        it0, it1 = iter(rank0), iter(rank1)
        take(it0, 2), take(it1, 2)
        yield rank0, rank1, it0, it1


def test_a_rank_that_gave_its_cut_up_fails_the_others_waits_at_once(node: tuple[ControlPlane, str]) -> None:
    """A rank whose state_dict() raised before it copied records phase 0 for that cut: the others at that cut fail at
    their next arrival (not WAIT_S later), naming it; its next cut, or a dead trainer's entry, is no such sign."""
    store, _ = node
    assert set(_barrier(store, 0).arrive(2, PAUSED)) == {1, 2}
    _barrier(store, 1).give_up(2)
    for local, phase in ((0, PAUSED), (2, PAUSED), (0, LISTED)):
        with pytest.raises(CheckpointError, match=r"checkpoint 2 cannot complete: global ranks \[5\] .* gave it up"):
            _barrier(store, local).arrive(2, phase)
    assert _barrier(store, 0).arrive(1, COPIED) == {}, "a rank at a later cut left the earlier one whole"
    _barrier(store, 1).arrive(3, PAUSED)  # its next checkpoint
    _barrier(store, 2, token="old").give_up(3)  # of a trainer whose claim is gone: only missing
    assert set(_barrier(store, 0).arrive(3, PAUSED)) == {2}


def test_a_rank_whose_checkpoint_failed_fails_the_others_at_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of a node of two calls state_dict() first and gives up waiting for rank 0 (WAIT_S is short here);
    rank 0's call of the same checkpoint then fails at its first barrier, naming rank 1, rather than waiting for a
    rank that is not coming. Both loaders read on."""
    monkeypatch.setattr(cutbarrier, "WAIT_S", 1.0)
    with _node_of_two(redis_url) as (rank0, rank1, it0, it1):
        with pytest.raises(CheckpointError, match=r"global rank 0 \(local rank 0: never took part in a cut\)"):
            rank1.state_dict()
        with pytest.raises(CheckpointError, match=r"checkpoint 1 cannot complete: global ranks \[1\] of this node"):
            rank0.state_dict()
        assert len(take(it0, 3)) == 3 and len(take(it1, 3)) == 3


def test_a_copy_refused_before_the_pause_fails_the_other_ranks_cut_at_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local rank 0 (it copies the buffer's rows) finds no memory for the copy (NOTE [ A buffer the node cannot hold ]
    in host/memory.py): its state_dict() raises before the pause and gives the cut up, so rank 1's call of the same
    checkpoint fails at its first barrier naming rank 0, not after WAIT_S (short here, so that a missing give-up
    shows as the other message). Both loaders read on."""
    monkeypatch.setattr(cutbarrier, "WAIT_S", 1.0)
    refused = "no memory for the copy, made to fail here"

    def refuse_on_local_rank_0(rows: int, layout: Any, sup: Any) -> None:
        if sup.config.local_rank == 0:
            raise CheckpointError(refused)

    monkeypatch.setattr(savedrows, "_refuse_beyond_memory", refuse_on_local_rank_0)
    with _node_of_two(redis_url) as (rank0, rank1, it0, it1):
        with pytest.raises(CheckpointError, match=refused):
            rank0.state_dict()
        with pytest.raises(CheckpointError, match=r"checkpoint 1 cannot complete: global ranks \[0\] of this node"):
            rank1.state_dict()
        assert len(take(it0, 3)) == 3 and len(take(it1, 3)) == 3


def test_a_mode_that_reads_rows_more_than_once_says_once_what_its_checkpoint_leaves_out(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``evict_on_read=False``: no rows saved, no node barrier (rank 1 of the node never calls), one warning."""
    queue = f"cbe-{uuid.uuid4().hex[:8]}"
    # Rank 1 never runs: rank 0's writer fills past the node's first mix without waiting for rank 1's.
    cfg = DataloaderConfig(bs=4, shuffle_size=64, queue_name=queue, num_writers=1, num_readers=1, evict_on_read=False,
                           local_world_size=2, global_world_size=2, redis_url=redis_url,
                           first_mix_wait_s=0.0)  # fmt: skip
    with MultiprocessShuffledDataloader(Counter(), cfg) as loader, caplog.at_level("WARNING"):
        take(iter(loader), 2)
        states = [loader.state_dict()["rank0"] for _ in range(2)]
    assert [s["rows"] for s in states] == [{}, {}]
    warned = [r.getMessage() for r in caplog.records if "saves only the datasets' positions" in r.getMessage()]
    assert len(warned) == 1 and "evict_on_read=False" in warned[0], warned
    late = [r.getMessage() for r in caplog.records if "first mix" in r.getMessage()]
    assert not late, f"first_mix_wait_s=0: no writer waits, so none is late: {late}"


def test_a_rank_at_a_later_checkpoint_before_the_last_phase_fails_the_cut_at_once(
    node: tuple[ControlPlane, str],
) -> None:
    """Ranks that numbered their checkpoints differently (one called state_dict() once more) must not pass each
    other's barriers: rank 1's entries of checkpoint 3 once satisfied every phase of rank 0's checkpoint 2. A dead
    trainer's later entry is no such sign (it does not count at all)."""
    store, _ = node
    _barrier(store, 1).arrive(3, PAUSED)
    _barrier(store, 2, token="old").arrive(7, PAUSED)  # of a trainer whose claim is gone: only missing
    for phase in (PAUSED, LISTED):
        with pytest.raises(CheckpointError, match=r"checkpoint 2 of this loader, but global rank 5 at checkpoint 3"):
            _barrier(store, 0).arrive(2, phase)
    _barrier(store, 2).arrive(2, COPIED)
    assert _barrier(store, 0).arrive(2, COPIED) == {}, "past the last phase, a later checkpoint is a rank gone on"
