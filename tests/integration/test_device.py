"""``device`` and ``pin_memory`` with real processes and Redis, on a machine without a GPU: ``device="cpu"``, and the
loader's CUDA path run against a fake CUDA that models streams and copies in flight (tests/fakecuda.py; NOTE
[ GPU placement ] in gigashuffle/trainer/pinning.py). The same on a real GPU: tests/gpu/."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import torch
from datasets import UniqueIds, check_unique_batch, take
from fakecuda import FakeCuda
from test_ctrl_c_lines import rings_whole

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.trainer import pinning

Batch = list[dict[str, torch.Tensor]]


def _each_row_once(batches: list[Batch]) -> None:
    """Every batch whole (no torn row) and no row in two of them; checked after the copies ran."""
    seen: set[int] = set()
    for batch in batches:
        ids = check_unique_batch(batch, 4, 64)
        assert not seen.intersection(ids), "a row was delivered twice"
        seen.update(ids)


def _config(redis_url: str, **fields: object) -> DataloaderConfig:
    return DataloaderConfig(
        bs=4, shuffle_size=64, queue_name=f"device-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        ring_depth=2, redis_url=redis_url, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_device_cpu_yields_the_usual_batches(redis_url: str) -> None:
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cpu")) as loader:
        seen: set[int] = set()
        for batch in take(iter(loader), 20):
            ids = check_unique_batch(batch, 4, 64)
            assert all(t.device.type == "cpu" for t in batch[0].values())
            assert not seen.intersection(ids), "a row was delivered twice"
            seen.update(ids)
        assert loader.metrics().h2d_per_batch_s is None, "no device copy: no host-to-device figure"


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda(devices=1)
    real = pinning.placement
    monkeypatch.setattr(pinning, "placement", lambda config: real(config, cuda))
    return cuda


def _pinned(cuda: FakeCuda, t: torch.Tensor) -> bool:
    return any(p <= t.data_ptr() < p + n for p, n in cuda.registered.items())


N = 40  # 20 times the ring's depth: every slot is reused many times while copies may be in flight


@pytest.mark.parametrize("gpu_runs", [False, True], ids=["GPU never runs by itself", "GPU runs each step"])
def test_device_mode_never_reuses_a_slot_under_its_copy(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, gpu_runs: bool
) -> None:
    cuda = _fake_cuda(monkeypatch)
    on_gpu: list[Batch] = []
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cuda")) as loader:
        it = iter(loader)
        for _ in range(N):
            batch = take(it, 1)[0]
            assert all(cuda.on_device(batch[0][key]) for key in ("id", "x", "y"))
            assert not cuda.on_device(batch[0][INDEX_KEY]), "the index stays on the CPU"
            on_gpu.append(batch)
            if gpu_runs:
                cuda.current_stream(0).advance()  # the step's kernels, which wait on the copy stream
        del batch
        assert len(cuda.registered) == 1, "the one reader's ring was registered when it arrived"
        assert cuda.copies == N, "one copy per batch"
        h2d = loader.metrics().h2d_per_batch_s
        assert h2d is not None and 0 < h2d < 1, h2d  # the trainer's share of the copies, per batch
        syncs = cuda.host_syncs
    assert cuda.registered == {} and cuda.unregistered_in_flight == 0
    cuda.advance_all()
    _each_row_once(on_gpu)  # every row checked after the copies ran
    if gpu_runs:
        assert syncs == 0, "the hot path never waited for the GPU"
    else:
        assert syncs > 0, "with every slot waiting on a copy, the loader waited for the oldest"


def test_pin_only_hands_out_pinned_views_and_reuses_a_slot_only_after_the_users_copy(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = _fake_cuda(monkeypatch)
    on_gpu: list[Batch] = []
    pinned = 0
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, pin_memory=True)) as loader:
        it = iter(loader)
        for _ in range(N):
            batch = take(it, 1)[0]
            pinned += all(_pinned(cuda, t) for t in batch[0].values())
            # The user's .to("cuda", non_blocking=True) on the current stream, then the batch is dropped.
            on_gpu.append([{key: cuda.copy(t, 0, cuda.current_stream(0)) for key, t in batch[0].items()}])
            del batch
        assert pinned == N, f"{N - pinned} of {N} batches were pageable copies"
    assert cuda.registered == {} and cuda.unregistered_in_flight == 0
    cuda.advance_all()
    _each_row_once(on_gpu)


# -- issue 33 ----------------------------------------------------------------------------------------------------
def _ring_whole(loader: MultiprocessShuffledDataloader, cuda: FakeCuda) -> tuple[bool, str]:
    """Whether every reader's ring comes back whole once the GPU ran what is queued (test_ctrl_c_lines.py's check,
    the fake GPU advanced and the loader's pending releases polled before each pump)."""

    def tick() -> None:
        cuda.advance_all()
        loader._placement.poll()
        loader._sup.inbox.flush()

    return rings_whole(loader, 30.0, readers=None, tick=tick)


def _ready_within(loader: MultiprocessShuffledDataloader, cuda: FakeCuda, seconds: float = 20.0) -> bool:
    sup = loader._sup
    deadline = time.monotonic() + seconds
    while not sup.inbox.ready and time.monotonic() < deadline:
        cuda.advance_all()
        loader._placement.poll()
        sup.inbox.flush()
        sup.pump(0.05)
    return bool(sup.inbox.ready)


def _refilled(loader: MultiprocessShuffledDataloader, seconds: float = 10.0) -> bool:
    """Whether a batch is ready within ``seconds``, the slots of dropped batches sent back meanwhile, with the fake
    GPU running nothing."""
    sup = loader._sup
    deadline = time.monotonic() + seconds
    while not sup.inbox.ready and time.monotonic() < deadline:
        sup.inbox.flush()
        sup.pump(0.05)
    return bool(sup.inbox.ready)


@pytest.mark.parametrize(
    "error",
    [lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), KeyboardInterrupt],
    ids=["CUDA OOM", "KeyboardInterrupt"],
)
def test_device_mode_a_catch_and_retry_loop_keeps_getting_batches_after_failed_copies(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, error: Callable[[], BaseException]
) -> None:
    cuda = _fake_cuda(monkeypatch)
    failures = 7  # more than ring_depth=2 times: each failure used to lose a ring slot for good
    kind = type(error())
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cuda")) as loader:
        it = iter(loader)
        kept = take(it, 1)
        cuda.copy_error = error
        cuda.fail_copies = failures
        caught = 0
        for n in range(failures):
            # next() would wait for ever once the ring's slots are lost: fail instead (the GPU runs meanwhile).
            assert _ready_within(loader, cuda), f"no batch ready after {n} failed copies: a ring slot was lost"
            try:
                next(it)
            except kind:
                caught += 1
                it = iter(loader)  # the generator ends with the exception: the retry asks for a new one
            cuda.current_stream(0).advance()
        assert caught == failures
        whole, detail = _ring_whole(loader, cuda)
        assert whole, f"the ring is not whole after {failures} failed copies: {detail}"
        for _ in range(N):
            kept.append(take(it, 1)[0])
            cuda.current_stream(0).advance()
        assert cuda.copies == N + 1
        whole, detail = _ring_whole(loader, cuda)
        assert whole, detail
    cuda.advance_all()
    _each_row_once(kept)


def test_pin_only_batches_stay_pinned_when_the_caller_holds_the_last_one_while_asking_for_the_next(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``for batch in loader:`` holds the previous batch while it asks for the next: with ring_depth=2 that is
    the ring's last free slot, so the loader hands out a copy; the copy must be pinned too (README, GPUs)."""
    cuda = _fake_cuda(monkeypatch)
    on_gpu: list[Batch] = []
    pinned = 0
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, pin_memory=True)) as loader:
        it = iter(loader)
        batch = next(it)
        for _ in range(N):
            pinned += all(cuda.is_pinned(t) for t in batch[0].values())
            on_gpu.append([{key: cuda.copy(t, 0, cuda.current_stream(0)) for key, t in batch[0].items()}])
            batch = next(it)  # the previous batch is still held while the next is made
        del batch
        assert pinned == N, f"{N - pinned} of {N} batches were pageable copies"
    cuda.advance_all()
    _each_row_once(on_gpu)


def test_pin_only_side_stream_prefetcher_with_release_after_never_reads_a_refilled_slot(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The common prefetcher: copy batch N on a side stream, drop the CPU batch, ask for batch N+1, and only then
    order the side stream onto the current one. ``loader.release_after(side)`` makes that safe. The side stream is
    slow and the current one has run all its work when N+1 is asked for, so an event on the current stream alone
    completes at once; a slot released then is refilled by its reader before the side copy runs."""
    cuda = _fake_cuda(monkeypatch)
    on_gpu: list[Batch] = []
    handed: list[list[int]] = []  # the ids of each batch as next() gave it, before any copy ran
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, pin_memory=True)) as loader:
        side = cuda.new_stream(0)
        loader.release_after(side)
        it = iter(loader)
        for _ in range(N):
            batch = next(it)
            handed.append(batch[0]["id"].tolist())
            on_gpu.append([{key: cuda.copy(t, 0, side) for key, t in batch[0].items()}])
            del batch
            cuda.current_stream(0).advance()  # the step's compute is done; the side copy is not
            next_one = next(it)  # asked for before the side stream is waited on
            if not loader._placement.pending:  # the dropped batch's slot went back under the side copy
                _refilled(loader)  # its reader gathers into it before that copy runs, as a slow DMA would see
            cuda.wait_stream(cuda.current_stream(0), side)
            handed.append(next_one[0]["id"].tolist())
            on_gpu.append([{key: cuda.copy(t, 0, cuda.current_stream(0)) for key, t in next_one[0].items()}])
            del next_one
    cuda.advance_all()
    _each_row_once(on_gpu)
    # A copy that read its slot's next fill still shows each row once (each copy reads the one after): compare.
    copied = [batch[0]["id"].tolist() for batch in on_gpu]
    wrong = sum(c != h for c, h in zip(copied, handed, strict=True))
    assert not wrong, f"{wrong} of {len(handed)} copies read other rows than next() handed out (a refilled slot)"
