"""GPU smoke test of NOTE [ GPU placement ] (gigashuffle/trainer/pinning.py): what the CPU tests prove against
tests/fakecuda.py, checked on a real GPU. Skipped without CUDA. One command, which prints the figures:

    python -m pytest tests/gpu -q -s -p no:cacheprovider

On a GPU machine without network, ``tests/gpu/run_offline.sh WHEELS_DIR`` installs the package and its test
dependencies from a folder of wheels (made elsewhere with ``pip download``) and runs this.

In order: the raw register/unregister calls and the error state they leave; the race in ``device=`` mode (copies
queued behind ``torch.cuda._sleep`` work, every row checked after a final synchronize) with a negative control
that records the release events on an idle side stream and must see torn or repeated rows; the same with
``pin_memory`` alone, with the share of pinned batches; one context per rank under torchrun (two ranks on two GPUs,
or both on the one GPU); close under load; ``device=`` against a manual ``.to()``, with the synchronizations on the
hot path; then (issue 33) image-sized rows of five dtypes read on the current stream right after ``next()`` with no
synchronize, with negative controls that drop ``wait_stream`` and ``record_stream``; a CUDA OOM in the copy more
times than the ring is deep; ``close()`` timed while the GPU is busy; the copy stream's priority and that it is none
of torch's pool. None of this was run when it was written (no GPU was lent): a failure may be the test's own.
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
from imagerows import ImageRows, bad_rows

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
        f"torch's libcudart found for cudaGetLastError: {cudaops._torch_cudart() is not None}"
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


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="reads the contexts with nvidia-smi")
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
    one_gpu = torch.cuda.device_count() == 1  # both ranks on the one GPU: each still makes exactly one context
    for r in ranks:
        own = 0 if one_gpu else r["local_rank"]
        print(f"\n[gpu 4] rank pid {r['pid']} local_rank {r['local_rank']} ({'one GPU' if one_gpu else 'a GPU each'}): "
              f"batches on {r['devices']}, contexts on {sorted(contexts.get(r['pid'], set()))}")  # fmt: skip
        assert r["devices"] == [f"cuda:{own}"], "device='cuda' is the rank's own GPU"
        assert contexts.get(r["pid"]) == {uuids[own]}, "one context per rank, on its own GPU"


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


# -- 7. image rows read on the current stream right after next(), no synchronize (issue 33) ------------------------
IMAGE_BS = 32
IMAGE_SHUFFLE = 512


class NoWaitStream(SlowCopies):
    """Negative control: the consumer stream does not wait for the copy (a read may run before the copy lands)."""

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        pass


class NoRecordStream(SlowCopies):
    """Negative control: the allocator is not told that the consumer stream uses the block, so a block the caller
    dropped is reused by the next copy while the consumer's queued read has not run."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass


def _image_config(redis_url: str, **fields: object) -> DataloaderConfig:
    return DataloaderConfig(
        bs=IMAGE_BS, shuffle_size=IMAGE_SHUFFLE, queue_name=f"gpu-img-{uuid.uuid4().hex[:8]}", num_writers=1,
        num_readers=1, ring_depth=2, redis_url=redis_url, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _image_run(redis_url: str, late: bool) -> tuple[int, int, int]:
    """(bad rows, repeated ids, rows) over STEPS batches, each read by kernels on the current stream enqueued right
    after next() returned: at once, or (``late``) behind ``3 * SLEEP_CYCLES`` of work, after the batch was dropped.
    One synchronize, at the end."""
    bad: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    with MultiprocessShuffledDataloader(ImageRows(), _image_config(redis_url, device="cuda")) as loader:
        it = iter(loader)
        for _ in range(STEPS):
            batch = next(it)[0]
            if late:
                _gpu_sleep(3 * SLEEP_CYCLES)
            bad.append(bad_rows(batch))
            ids.append(batch["id"].clone())
            del batch  # dropped while its reads are queued
    torch.cuda.synchronize()
    every = torch.cat(ids).cpu()
    return int(torch.stack(bad).sum()), every.numel() - every.unique().numel(), every.numel()


@pytest.mark.parametrize("late", [False, True], ids=["read at once", "read after the drop"])
def test_7_image_rows_read_on_the_current_stream_right_after_next(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, late: bool
) -> None:
    _use(monkeypatch, SlowCopies())
    bad, repeated, total = _image_run(redis_url, late)
    print(f"\n[gpu 7] device=, image rows, {'late' if late else 'immediate'} reads: {bad} bad, {repeated} repeated "
          f"of {total}")  # fmt: skip
    assert (bad, repeated) == (0, 0)


@pytest.mark.parametrize(
    ("ops", "late"), [(NoWaitStream, False), (NoRecordStream, True)], ids=["no wait_stream", "no record_stream"]
)
def test_7_negative_controls_see_the_race(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, ops: type[CudaOps], late: bool
) -> None:
    _use(monkeypatch, ops())
    bad, repeated, total = _image_run(redis_url, late)
    print(f"\n[gpu 7 control] {ops.__name__}: {bad} bad, {repeated} repeated of {total}")
    assert bad + repeated > 0, "the control must see the race, else the positive test above proves nothing"


# -- 8. a CUDA OOM in the copy, more times than the ring is deep (issue 33) ----------------------------------------
class FailingCopies(CudaOps):
    def __init__(self) -> None:
        self.failures = 0

    def copy(self, src: torch.Tensor, index: int, stream: Any) -> torch.Tensor:
        if self.failures:
            self.failures -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return super().copy(src, index, stream)


def test_8_oom_in_the_copy_loses_no_ring_slot(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = FailingCopies()
    _use(monkeypatch, ops)
    caught = 0
    with MultiprocessShuffledDataloader(ImageRows(), _image_config(redis_url, device="cuda")) as loader:
        it = iter(loader)
        next(it)
        ops.failures = 7
        for _ in range(7):
            try:
                next(it)
            except torch.cuda.OutOfMemoryError:
                caught += 1
                it = iter(loader)
        start = time.monotonic()
        bad = torch.stack([bad_rows(next(it)[0]) for _ in range(STEPS)]).sum()  # hangs (test timeout) if slots lost
        elapsed = time.monotonic() - start
    print(f"\n[gpu 8] {caught} OOMs caught, then {STEPS} batches in {elapsed:.2f} s, {int(bad)} bad rows")
    assert caught == 7 and int(bad) == 0


# -- 9. close() while the GPU is busy (issue 33) --------------------------------------------------------------------
BUSY_CYCLES = 4_000_000_000  # about 2 s of GPU time at 2 GHz on the current stream


def test_9_close_waits_only_for_its_own_events(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with MultiprocessShuffledDataloader(ImageRows(), _image_config(redis_url, device="cuda")) as loader:
        it = iter(loader)
        held = [next(it) for _ in range(4)]
        torch.cuda.synchronize()
        _gpu_sleep(BUSY_CYCLES)  # a step (or a collective waiting for a dead rank) on the current stream
        start = time.perf_counter()
        loader.close()
        device_close = time.perf_counter() - start
    torch.cuda.synchronize()
    assert int(torch.stack([bad_rows(b[0]) for b in held]).sum()) == 0
    monkeypatch.setattr(pinning, "CLOSE_WAIT_S", 0.5)
    kept = len(pinning._STILL_REGISTERED)
    with MultiprocessShuffledDataloader(ImageRows(), _image_config(redis_url, pin_memory=True)) as loader:
        batch = next(iter(loader))[0]
        _gpu_sleep(BUSY_CYCLES)
        on_gpu = {key: t.to("cuda", non_blocking=True) for key, t in batch.items() if key != INDEX_KEY}
        start = time.perf_counter()
        loader.close()  # the caller holds the batch and its copy is queued behind the busy stream
        pin_close = time.perf_counter() - start
    left_registered = len(pinning._STILL_REGISTERED) - kept
    torch.cuda.synchronize()
    assert not _launch_raises()
    bad = int(bad_rows(on_gpu))
    print(
        f"\n[gpu 9] close with the current stream busy ~2 s: device= {device_close:.3f} s; pin-only "
        f"{pin_close:.3f} s (deadline 0.5 s), rings left registered {left_registered}, {bad} bad rows"
    )
    assert device_close < 1.0, "device= close waited for the current stream, not only its own copies"
    assert 0.4 < pin_close < 1.5 and left_registered >= 1, "pin-only close must give up at its deadline"
    assert bad == 0
    del batch


# -- 10. the copy stream (issue 33) ---------------------------------------------------------------------------------
def test_10_the_copy_stream_is_the_loaders_own_at_the_highest_priority() -> None:
    ops = CudaOps()
    with ops.guard(0):
        stream = ops.copy_stream(0)
        assert ops.copy_stream(0) is stream, "one copy stream per device"
        pool = {torch.cuda.Stream(0, priority=p).cuda_stream for p in (0, -1) for _ in range(64)}  # type: ignore[no-untyped-call]
    _least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[no-untyped-call]
    dedicated = stream.cuda_stream not in pool
    print(
        f"\n[gpu 10] copy stream {stream.cuda_stream:#x}: priority {stream.priority} (greatest {greatest}), "
        f"dedicated (none of torch's pool): {dedicated}, torch's runtime found: {cudaops._torch_cudart() is not None}"
    )
    assert stream.priority == greatest
    assert dedicated or cudaops._torch_cudart() is None
