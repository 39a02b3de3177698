"""GPU smoke test of NOTE [ GPU placement ] (gigashuffle/trainer/pinning.py): what the CPU tests prove against
tests/fakecuda.py, checked on a real GPU. Skipped without CUDA. One command, which prints the figures:

    python -m pytest tests/gpu -q -s -p no:cacheprovider

In order: the raw register/unregister calls and the error state they leave; the race in ``device=`` mode (copies
queued behind ``torch.cuda._sleep`` work, every row checked after a final synchronize) with a negative control
that records the release events on an idle side stream and must see torn or repeated rows; the same with
``pin_memory`` alone, with the share of pinned batches; one context per rank under torchrun (2 GPUs or more);
close under load; ``device=`` against a manual ``.to()``, with the synchronizations on the hot path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import UniqueIds, check_unique_batch

from gigashuffle import INDEX_KEY, DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.shm.buffer import SharedMemory
from gigashuffle.trainer import cudaops, pinning
from gigashuffle.trainer.cudaops import CudaOps, Event

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

Batch = list[dict[str, torch.Tensor]]
BS = 64
SHUFFLE = 1024
STEPS = 40  # 20 times the ring's depth: every slot is reused many times while copies are in flight
SLEEP_CYCLES = 20_000_000  # about 10 ms of GPU time at 2 GHz before each copy


def _config(redis_url: str, **fields: object) -> DataloaderConfig:
    fields.setdefault("ring_depth", 2)
    return DataloaderConfig(
        bs=BS, shuffle_size=SHUFFLE, queue_name=f"gpu-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        redis_url=redis_url, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


class SlowCopies(CudaOps):
    """The real CUDA calls, with ``SLEEP_CYCLES`` of GPU work queued before each of the loader's copies, so that a
    copy is still in flight long after the call that enqueued it returned."""

    def copy(self, src: torch.Tensor, index: int, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            _gpu_sleep(SLEEP_CYCLES)
        return super().copy(src, index, stream)


class IdleStreamEvents(SlowCopies):
    """Negative control: every release event is recorded on a fresh, idle side stream (the defect the NOTE's
    protocol rules out), so it completes at once and the ring slot is reused under the copy."""

    def record(self, event: Event, stream: Any) -> None:
        super().record(event, torch.cuda.Stream(stream.device))  # type: ignore[no-untyped-call]


def _gpu_sleep(cycles: int) -> None:
    """GPU work on the current stream that keeps it busy for ``cycles`` clock cycles."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def _use(monkeypatch: pytest.MonkeyPatch, cuda: CudaOps) -> None:
    real = pinning.placement
    monkeypatch.setattr(pinning, "placement", lambda config: real(config, cuda))


def _damage(batches: list[Batch]) -> tuple[int, int]:
    """(torn rows, repeated rows) over ``batches`` (read on the CPU after a synchronize)."""
    torn = repeated = 0
    seen: set[int] = set()
    for batch in batches:
        group = {key: t.cpu() for key, t in batch[0].items()}
        ids = group["id"]
        torn += int((group["x"] != ids.unsqueeze(1)).any(dim=1).sum()) + int((group["y"] != -ids.double()).sum())
        for i in ids.tolist():
            repeated += i in seen
            seen.add(i)
    return torn, repeated


def _check(batches: list[Batch]) -> None:
    seen: set[int] = set()
    for batch in batches:
        ids = check_unique_batch([{key: t.cpu() for key, t in batch[0].items()}], BS, SHUFFLE)
        assert not seen.intersection(ids), "a row was delivered twice"
        seen.update(ids)


def _launch_raises() -> bool:
    """Whether a kernel launch now raises an error left set by an earlier call (torch checks after each launch)."""
    try:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    except RuntimeError:
        return True
    return False


# -- 1. the raw calls -----------------------------------------------------------------------------------------------
def test_1_register_unregister_and_the_error_they_leave() -> None:
    cuda = CudaOps()
    nbytes = 1 << 20
    memory = SharedMemory(nbytes, name="gs-gpu-smoke")
    anchor = memory.view(0, nbytes)
    ptr = anchor.data_ptr()
    with cuda.guard(0):
        assert cuda.host_register(ptr, nbytes) == 0
        assert anchor.is_pinned(), "registered memory is pinned memory to torch"
        code = cuda.host_register(ptr, nbytes)
        assert code != 0, "registering twice must fail"
        left_set = _launch_raises()  # what a failed register does to the user's next launch when not cleared
        code = cuda.host_register(ptr, nbytes)
        cuda.clear_error(0)
        assert not _launch_raises(), "clear_error did not clear the error a failed register left"
        assert cuda.host_unregister(ptr) == 0
        assert not anchor.is_pinned()
        code2 = cuda.host_unregister(ptr)
        cuda.clear_error(0)
        assert code2 != 0 and not _launch_raises()
    print(
        f"\n[gpu 1] register twice: {cuda.error_name(code)}; unregister twice: {cuda.error_name(code2)}; "
        f"a failed register left the error set for the next launch: {left_set}; "
        f"libcudart found for cudaGetLastError: {cudaops._libcudart() is not None}"
    )
    del anchor
    memory.close()


# -- 2. the race in device= mode ------------------------------------------------------------------------------------
def _device_run(redis_url: str) -> list[Batch]:
    out: list[Batch] = []
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cuda")) as loader:
        it = iter(loader)
        for _ in range(STEPS):
            batch = next(it)
            assert batch[0]["x"].device == torch.device("cuda", 0)
            assert batch[0][INDEX_KEY].device.type == "cpu", "the index stays on the CPU"
            out.append(batch)
    torch.cuda.synchronize()
    return out


def test_2_device_mode_never_reuses_a_slot_under_its_copy(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, SlowCopies())
    batches = _device_run(redis_url)
    torn, repeated = _damage(batches)
    print(f"\n[gpu 2] device=: {STEPS} batches, copies behind {SLEEP_CYCLES} cycles: {torn} torn, {repeated} repeated")
    _check(batches)


def test_2_negative_control_events_on_an_idle_stream_tear_rows(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, IdleStreamEvents())
    torn, repeated = _damage(_device_run(redis_url))
    print(f"\n[gpu 2 control] device=, events on an idle stream: {torn} torn, {repeated} repeated rows")
    assert torn + repeated > 0, "the control must see the race, else the positive test above proves nothing"


# -- 3. the same with pin_memory alone ------------------------------------------------------------------------------
def _pin_only_run(redis_url: str) -> tuple[list[Batch], int]:
    out: list[Batch] = []
    pinned = 0
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, pin_memory=True)) as loader:
        it = iter(loader)
        for _ in range(STEPS):
            batch = next(it)
            pinned += all(t.is_pinned() for t in batch[0].values())
            _gpu_sleep(SLEEP_CYCLES)  # the step's kernels: the user's copy queues behind them
            out.append([{key: t.to("cuda", non_blocking=True) for key, t in batch[0].items()}])
            del batch  # dropped while its copy is queued
    torch.cuda.synchronize()
    return out, pinned


def test_3_pin_only_never_reuses_a_slot_under_the_users_copy(redis_url: str) -> None:
    batches, pinned = _pin_only_run(redis_url)
    torn, repeated = _damage(batches)
    print(f"\n[gpu 3] pin_memory: {pinned}/{STEPS} batches pinned ({100 * pinned // STEPS}%), {torn} torn, "
          f"{repeated} repeated")  # fmt: skip
    _check(batches)
    assert pinned == STEPS, "a batch was a pageable copy"


def test_3_negative_control_pin_only_events_on_an_idle_stream(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, IdleStreamEvents())
    batches, _pinned = _pin_only_run(redis_url)
    torn, repeated = _damage(batches)
    print(f"\n[gpu 3 control] pin_memory, events on an idle stream: {torn} torn, {repeated} repeated rows")
    assert torn + repeated > 0


# -- 4. one context per rank ----------------------------------------------------------------------------------------
def _contexts() -> dict[int, set[str]]:
    """pid -> the uuids of the GPUs it has a context on (nvidia-smi --query-compute-apps)."""
    text = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    found: dict[int, set[str]] = {}
    for line in text.splitlines():
        if "," in line:
            pid, gpu = (part.strip() for part in line.split(",", 1))
            found.setdefault(int(pid), set()).add(gpu)
    return found


def _gpu_uuids() -> list[str]:
    text = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60,
        check=True,
    ).stdout  # fmt: skip
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.mark.skipif(torch.cuda.device_count() < 2 or shutil.which("nvidia-smi") is None, reason="needs 2 GPUs")
def test_4_one_context_per_rank_under_torchrun(redis_url: str, tmp_path: Path) -> None:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        pytest.skip("compares nvidia-smi's GPU order with LOCAL_RANK: run without CUDA_VISIBLE_DEVICES")
    job = Path(__file__).with_name("context_job.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent / "integration"), *sys.path]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(job),
           "--redis-url", redis_url, "--queue", f"ctx-{uuid.uuid4().hex[:8]}", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.glob("rank-*.json"))) < 2:
            assert proc.poll() is None, f"the torchrun job ended with {proc.returncode} before both ranks reported"
            assert time.monotonic() < deadline, "the ranks did not report within 300 s"
            time.sleep(0.2)
        contexts = _contexts()
        uuids = _gpu_uuids()
        ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
        (tmp_path / "release").touch()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    if not any(r["pid"] in contexts for r in ranks):
        pytest.skip(f"nvidia-smi lists none of the ranks' pids (a pid namespace?): {contexts}")
    for r in ranks:
        print(f"\n[gpu 4] rank pid {r['pid']} local_rank {r['local_rank']}: batches on {r['devices']}, "
              f"contexts on {sorted(contexts.get(r['pid'], set()))}")  # fmt: skip
        assert r["devices"] == [f"cuda:{r['local_rank']}"], "device='cuda' is the rank's own GPU"
        assert contexts.get(r["pid"]) == {uuids[r["local_rank"]]}, "one context per rank, on its own GPU"


# -- 5. close under load --------------------------------------------------------------------------------------------
def test_5_close_with_copies_in_flight(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, SlowCopies())
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cuda")) as loader:
        it = iter(loader)
        held = [next(it) for _ in range(8)]
    # The loader closed with copies queued behind 8 sleeps: it synchronized, then unregistered.
    torch.cuda.synchronize()
    assert not _launch_raises()
    _check(held)
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, pin_memory=True)) as loader:
        batch = next(iter(loader))
        _gpu_sleep(SLEEP_CYCLES * 10)
        on_gpu = [{key: t.to("cuda", non_blocking=True) for key, t in batch[0].items()}]
    torch.cuda.synchronize()  # the caller still held the batch: close waited for its copy before unregistering
    assert not _launch_raises()
    _check([on_gpu])
    del batch
    print("\n[gpu 5] close with copies in flight: rows intact, no CUDA error")


# -- 6. device= against a manual .to() ------------------------------------------------------------------------------
class CountedSyncs(CudaOps):
    """The real calls, counting the host waits the loader makes (event and device synchronizes)."""

    def __init__(self) -> None:
        self.waits = 0

    def new_event(self) -> Event:
        event = super().new_event()
        wait = event.synchronize

        def counted() -> None:
            self.waits += 1
            wait()

        event.synchronize = counted  # type: ignore[method-assign]
        return event


def _hot_path(loader: MultiprocessShuffledDataloader, move: Callable[[Batch], Batch], steps: int) -> tuple[float, int]:
    """Seconds per batch and CUDA synchronizations (torch's sync debug mode) over ``steps`` batches."""
    it = iter(loader)
    for _ in range(10):  # warm-up: rings registered, copy stream made, allocator warm
        move(next(it))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            for _ in range(steps):
                batch = move(next(it))
                (batch[0]["x"].float().sum() + batch[0]["y"].sum()).neg_()  # a step's kernel on the batch
                del batch
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # not counted: the end of the measured stretch, not the hot path
    elapsed = time.perf_counter() - start
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return elapsed / steps, syncs


def test_6_device_mode_against_a_manual_to(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = 300
    counted = CountedSyncs()
    _use(monkeypatch, counted)
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, device="cuda", ring_depth=8)) as loader:
        ours, ours_syncs = _hot_path(loader, lambda b: b, steps)
    monkeypatch.undo()
    with MultiprocessShuffledDataloader(UniqueIds(), _config(redis_url, ring_depth=8)) as loader:
        manual, manual_syncs = _hot_path(
            loader, lambda b: [{k: t.to("cuda") for k, t in g.items() if k != INDEX_KEY} for g in b], steps
        )
    print(
        f"\n[gpu 6] {steps} batches of {BS} rows: device= {ours * 1e6:.0f} us/batch, {ours_syncs} syncs flagged, "
        f"{counted.waits} waits on a copy; manual .to() {manual * 1e6:.0f} us/batch, {manual_syncs} syncs flagged"
    )
    assert ours_syncs == 0, "device= synchronized on the hot path"
