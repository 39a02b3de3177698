"""``device`` and ``pin_memory`` with real processes and Redis, on a machine without a GPU: ``device="cpu"``, and the
loader's CUDA path run against a fake CUDA that models streams and copies in flight (tests/fakecuda.py; NOTE
[ GPU placement ] in gigashuffle/trainer/pinning.py). The same on a real GPU: tests/gpu/."""

from __future__ import annotations

import uuid

import pytest
import torch
from datasets import UniqueIds, check_unique_batch, take
from fakecuda import FakeCuda

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.trainer import pinning

Batch = list[dict[str, torch.Tensor]]


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
    seen: set[int] = set()
    for batch in on_gpu:  # every row checked after the copies ran
        ids = check_unique_batch(batch, 4, 64)
        assert not seen.intersection(ids), "a row was delivered twice"
        seen.update(ids)
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
    seen: set[int] = set()
    for batch in on_gpu:
        ids = check_unique_batch(batch, 4, 64)
        assert not seen.intersection(ids), "a row was delivered twice"
        seen.update(ids)
