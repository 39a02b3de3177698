"""Picklable test datasets and the helpers that check what they produce.

They live in an importable module (not inside test functions) because the loader pickles the dataset to its
writer processes, which import it by name. Every dataset derives all fields of a row from one integer id, so a
test can check any batch exactly: a torn row (fields of two different ids) or a wrong dtype shows up at once.

Ids are globally unique: ``id = base + worker_id * ID_STRIDE + counter`` where ``worker_id`` is what
``torch.utils.data.get_worker_info()`` reports in the writer (unique across writers and ranks).
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from timing import startup_deadline
from torch.utils.data import IterableDataset, get_worker_info

from gigashuffle import INDEX_KEY

ID_STRIDE = 10**8  # ids of one writer: [worker_id * ID_STRIDE, (worker_id + 1) * ID_STRIDE)

Chunk = list[dict[str, Any]]
Batch = list[dict[str, torch.Tensor]]


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    if info is None:
        return 0, 1
    return info.id, info.num_workers


def writer_of(ids: torch.Tensor | np.ndarray | int, base: int = 0) -> Any:
    return (ids - base) // ID_STRIDE


def counter_of(ids: torch.Tensor | np.ndarray | int, base: int = 0) -> Any:
    return (ids - base) % ID_STRIDE


# -- the workhorse: unique ids, three fields per row -----------------------------------------------------------


def unique_chunk(ids: torch.Tensor) -> Chunk:
    """``id`` int64, ``x`` int64[3] = id repeated, ``y`` float64 = -id."""
    return [{"id": ids, "x": ids.unsqueeze(1).repeat(1, 3), "y": -ids.to(torch.float64)}]


def check_unique_batch(batch: Batch, bs: int, shuffle_size: int) -> list[int]:
    """Assert the shape of a batch of ``UniqueIds`` and that no row is torn; return its ids."""
    assert isinstance(batch, list) and len(batch) == 1 and isinstance(batch[0], dict)
    group = batch[0]
    assert set(group) == {"id", "x", "y", INDEX_KEY}
    ids, x, y, index = group["id"], group["x"], group["y"], group[INDEX_KEY]
    assert ids.dtype == torch.int64 and ids.shape == (bs,)
    assert x.dtype == torch.int64 and x.shape == (bs, 3)
    assert y.dtype == torch.float64 and y.shape == (bs,)
    assert index.dtype == torch.int64 and index.shape == (bs,)
    assert bool((index >= 0).all()) and bool((index < shuffle_size).all()), index
    assert torch.equal(x, ids.unsqueeze(1).expand(bs, 3)), f"torn row: x={x} ids={ids}"
    assert torch.equal(y, -ids.to(torch.float64)), f"torn row: y={y} ids={ids}"
    return [int(i) for i in ids]


class UniqueIds(IterableDataset):  # type: ignore[type-arg]
    """Endless chunks of ``chunk`` rows with globally unique ids (see the module docstring)."""

    def __init__(self, chunk: int = 8, base: int = 0) -> None:
        self.chunk = chunk
        self.base = base

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        first = self.base + wid * ID_STRIDE
        for n in itertools.count(0, self.chunk):
            yield unique_chunk(torch.arange(first + n, first + n + self.chunk, dtype=torch.int64))


class SlowUniqueIds(UniqueIds):
    """``UniqueIds`` that sleeps between chunks, so that a buffer fills slowly enough to watch."""

    def __init__(self, chunk: int = 8, base: int = 0, sleep_s: float = 0.05) -> None:
        super().__init__(chunk, base)
        self.sleep_s = sleep_s

    def __iter__(self) -> Iterator[Chunk]:
        for chunk in super().__iter__():
            time.sleep(self.sleep_s)
            yield chunk


class LateUniqueIds(UniqueIds):
    """``UniqueIds`` whose writers with ``get_worker_info().id`` in ``late`` sleep ``late_s`` before their first
    chunk: a writer whose source is slow to start (NOTE [ First mix ] in procs/firstmix.py)."""

    def __init__(self, chunk: int = 8, late: Sequence[int] = (1,), late_s: float = 1.0) -> None:
        super().__init__(chunk)
        self.late = tuple(late)
        self.late_s = late_s

    def __iter__(self) -> Iterator[Chunk]:
        if _worker()[0] in self.late:
            time.sleep(self.late_s)
        yield from super().__iter__()


class FiniteUniqueIds(UniqueIds):
    """Exactly ``rows`` unique ids per writer (counters ``0 .. rows - 1``), then nothing more, ever.

    Ending the iterator would start another pass with the same ids, so the writer parks in ``__iter__`` instead
    (in short sleeps, until its loader kills it at close): what it wrote is then a known, finite set, and a test
    can check that every row written was delivered.
    """

    def __init__(self, rows: int, chunk: int = 8, base: int = 0) -> None:
        if rows % chunk:
            raise ValueError(f"rows={rows} must be a multiple of chunk={chunk}")
        super().__init__(chunk, base)
        self.rows = rows

    def __iter__(self) -> Iterator[Chunk]:
        yield from itertools.islice(super().__iter__(), self.rows // self.chunk)
        while True:
            time.sleep(0.05)


class _Resumable:
    """A dataset whose whole state is a ``resumed`` flag, which a test's ``load_state_dict`` sets."""

    resumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"resumed": self.resumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resumed = int(state["resumed"])


class GatedUniqueIds(_Resumable, UniqueIds):
    """``UniqueIds`` whose ``i``-th chunk comes only once ``allowed_file`` holds a number above ``i`` (a source
    waiting for data: the writer parks in ``__iter__``, in short sleeps), and whose share is empty, every pass, after
    ``load_state_dict({"resumed": 1})``."""

    def __init__(self, allowed_file: str, chunk: int = 4) -> None:
        super().__init__(chunk)
        self.allowed_file = allowed_file

    def _allowed(self) -> int:
        try:
            with open(self.allowed_file) as f:
                return int(f.read().strip() or 0)
        except FileNotFoundError:
            return 0

    def __iter__(self) -> Iterator[Chunk]:
        if self.resumed:
            return
        for i, chunk in enumerate(super().__iter__()):
            while self._allowed() <= i:
                time.sleep(0.01)
            yield chunk


class FirstWriterWaits(UniqueIds):
    """``UniqueIds`` whose writer 0 yields one chunk and then waits for data that never comes (a stream source with
    nothing new), while the other writers start once ``gate_file`` exists and then yield forever."""

    def __init__(self, gate_file: str, chunk: int = 4) -> None:
        super().__init__(chunk)
        self.gate_file = gate_file

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        while wid != 0 and not os.path.exists(self.gate_file):
            time.sleep(0.01)
        for i, chunk in enumerate(super().__iter__()):
            while wid == 0 and i >= 1:
                time.sleep(0.01)
            yield chunk


# -- training context and worker info --------------------------------------------------------------------------


class ContextEcho(IterableDataset):  # type: ignore[type-arg]
    """Rows carry ``ctx`` = the ``context`` the trainer attached (``-1`` before any), read at every chunk."""

    def __init__(self, chunk: int = 4) -> None:
        self.chunk = chunk

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        for n in itertools.count(0, self.chunk):
            context = getattr(self, "context", None)
            value = -1 if context is None else int(context["step"] if isinstance(context, dict) else context)
            ids = torch.arange(n, n + self.chunk, dtype=torch.int64) + wid * ID_STRIDE
            yield [{"id": ids, "ctx": torch.full((self.chunk,), value, dtype=torch.int64)}]


class EnvEcho(IterableDataset):  # type: ignore[type-arg]
    """Rows carry ``mark`` = the writer's ``int(os.environ["GS_TEST_MARK"])``: the environment a child started with."""

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        mark = int(os.environ["GS_TEST_MARK"])
        for n in itertools.count(0, 4):
            ids = torch.arange(n, n + 4, dtype=torch.int64) + wid * ID_STRIDE
            yield [{"id": ids, "mark": torch.full((4,), mark, dtype=torch.int64)}]


class WorkerInfoEcho(IterableDataset):  # type: ignore[type-arg]
    """Rows carry the writer's ``get_worker_info()``: ``wid``, ``nw``, and whether ``info.dataset`` is self."""

    def __iter__(self) -> Iterator[Chunk]:
        info = get_worker_info()
        if info is None:
            raise RuntimeError("get_worker_info() is None in a gigashuffle writer")
        is_self = info.dataset is self
        for n in itertools.count(0, 4):
            ids = torch.arange(n, n + 4, dtype=torch.int64) + info.id * ID_STRIDE
            yield [
                {
                    "id": ids,
                    "wid": torch.full((4,), info.id, dtype=torch.int64),
                    "nw": torch.full((4,), info.num_workers, dtype=torch.int64),
                    "is_self": torch.full((4,), is_self, dtype=torch.bool),
                }
            ]


class SeedEcho(IterableDataset):  # type: ignore[type-arg]
    """Rows carry the writer's seeds and a draw from each RNG made when ``__iter__`` starts: deterministic per seed.

    ``wid``, ``seed`` (``get_worker_info().seed``), ``initial`` (``torch.initial_seed()``), ``py``/``np``/``pt``
    (``random``, numpy and torch draws); ids are unique per writer as in ``UniqueIds``.
    """

    def __iter__(self) -> Iterator[Chunk]:
        info = get_worker_info()
        if info is None:
            raise RuntimeError("get_worker_info() is None in a gigashuffle writer")
        draws = {
            "py": random.getrandbits(62),
            "np": int(np.random.randint(0, 2**62, dtype=np.int64)),
            "pt": int(torch.randint(0, 2**62, ())),
        }
        fixed = {"wid": info.id, "seed": info.seed, "initial": torch.initial_seed(), **draws}
        for n in itertools.count(0, 4):
            row = {key: torch.full((4,), value, dtype=torch.int64) for key, value in fixed.items()}
            yield [{"id": torch.arange(n, n + 4, dtype=torch.int64) + info.id * ID_STRIDE, **row}]


class FewShards(_Resumable, IterableDataset):  # type: ignore[type-arg]
    """A source with ``shards`` shards split by worker, as Hugging Face and webdataset split theirs: writers with
    ``id >= shards`` get nothing, every pass. Each ``__iter__`` appends its worker id to ``passes_file``."""

    def __init__(self, shards: int, passes_file: str) -> None:
        self.shards = shards
        self.passes_file = passes_file

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        with open(self.passes_file, "a") as f:
            f.write(f"{wid}\n")
        if wid >= self.shards:
            return
        yield from UniqueIds(chunk=4).__iter__()


def passes_by_worker(passes_file: str) -> dict[int, int]:
    """How often each worker id started a pass of ``FewShards``."""
    try:
        with open(passes_file) as f:
            ids = [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return {}
    return {wid: ids.count(wid) for wid in set(ids)}


# -- checkpointing ---------------------------------------------------------------------------------------------


class ProcessIds(IterableDataset):  # type: ignore[type-arg]
    """Endless chunks of ``unique_chunk`` rows whose ids name the writer process (``pid << 32`` plus a count): a
    respawned writer's rows never repeat its predecessor's."""

    def __init__(self, chunk: int = 8) -> None:
        self.chunk = chunk

    def __iter__(self) -> Iterator[Chunk]:
        first = os.getpid() << 32
        for n in itertools.count(0, self.chunk):
            yield unique_chunk(torch.arange(first + n, first + n + self.chunk, dtype=torch.int64))


class Counter(IterableDataset):  # type: ignore[type-arg]
    """Rows ``id`` (unique), ``counter`` (per writer, from ``pos``); ``state_dict`` is ``{"pos": next counter}``."""

    def __init__(self, chunk: int = 8) -> None:
        self.chunk = chunk
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = int(state["pos"])

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        while True:
            start = self.pos
            self.pos += self.chunk
            counter = torch.arange(start, start + self.chunk, dtype=torch.int64)
            yield [{"id": counter + wid * ID_STRIDE, "counter": counter}]


class WideRows(Counter):
    """``Counter``'s rows, two a chunk, with ``x``: ``row_bytes`` zero bytes a row (a buffer of few slots and many
    bytes)."""

    def __init__(self, row_bytes: int) -> None:
        super().__init__(chunk=2)
        self.row_bytes = row_bytes

    def __iter__(self) -> Iterator[Chunk]:
        for chunk in super().__iter__():
            chunk[0]["x"] = torch.zeros(self.chunk, self.row_bytes, dtype=torch.uint8)
            yield chunk


class PassIds(IterableDataset):  # type: ignore[type-arg]
    """``ids`` rows per writer per pass: ``id = worker * ID_STRIDE + i`` and ``pass``; the state is
    ``{"pass", "pos", "late_s"}``. A writer whose loaded state has ``late_s`` > 0 sleeps that long before its next
    chunk, once (its later states say 0): a source slow to start again after a resume, in one writer only."""

    def __init__(self, ids: int, chunk: int) -> None:
        self.ids, self.chunk = ids, chunk
        self.passes, self.pos, self.late_s = 0, 0, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self.passes, "pos": self.pos, "late_s": self.late_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.passes, self.pos = int(state["pass"]), int(state["pos"])
        self.late_s = float(state.get("late_s", 0.0))

    def __iter__(self) -> Iterator[Chunk]:
        worker = _worker()[0]
        while self.pos < self.ids:
            if self.late_s:
                time.sleep(self.late_s)
                self.late_s = 0.0
            start, self.pos = self.pos, min(self.pos + self.chunk, self.ids)
            ids = torch.arange(start, self.pos, dtype=torch.int64) + worker * ID_STRIDE
            yield [{"id": ids, "pass": torch.full_like(ids, self.passes)}]
        self.passes, self.pos = self.passes + 1, 0


# -- every dtype -----------------------------------------------------------------------------------------------

DTYPES: tuple[torch.dtype, ...] = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


def dtype_key(dtype: torch.dtype) -> str:
    return "f_" + str(dtype).removeprefix("torch.")


def dtype_values(ids: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Exactly representable values of ``dtype`` derived from int64 ``ids``, as numpy (bfloat16: as float32)."""
    i = ids.astype(np.int64)
    if dtype == torch.bool:
        return np.asarray((i % 2) == 1)
    if dtype == torch.uint8:
        return (i % 251 + 3).astype(np.uint8)
    if dtype == torch.int8:
        return (i % 251 - 125).astype(np.int8)
    if dtype == torch.int16:
        return (i % 30011 - 15005).astype(np.int16)
    if dtype == torch.int32:
        return (i * 7919 % 2_000_000_011 - 1_000_000_005).astype(np.int32)
    if dtype == torch.int64:
        return -(i * 1_000_003) - 2**40
    if dtype == torch.uint16:
        return (i % 65521 + 7).astype(np.uint16)
    if dtype == torch.uint32:
        return (i * 7 % 4_294_967_291 + 1).astype(np.uint32)
    if dtype == torch.uint64:
        return i.astype(np.uint64) + np.uint64(2**63 + 11)  # the top bit set: no signed round trip hides a bug
    if dtype == torch.float16:
        return (i % 2048 - 1024).astype(np.float16)
    if dtype == torch.bfloat16:
        return (i % 256 - 128).astype(np.float32)  # integers up to 256 are exact in bfloat16
    if dtype == torch.float32:
        return (i % 2**20).astype(np.float32) + np.float32(0.5)
    if dtype == torch.float64:
        return i.astype(np.float64) + 0.25
    raise AssertionError(f"no values for {dtype}")


def _group1(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The second group of a multi-group chunk: multi-dimensional rows."""
    i = ids.astype(np.int64)
    grid = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    return {
        "grid": (i % 4096).astype(np.float32).reshape(-1, 1, 1) * 10 + grid,  # float32[2, 3]
        "pair": np.stack([i, -i], axis=1).astype(np.int64),  # int64[2]
    }


def dtype_chunk(ids: np.ndarray, as_numpy: bool, groups: int) -> Chunk:
    group0: dict[str, Any] = {"id": ids if as_numpy else torch.from_numpy(ids)}
    for dtype in DTYPES:
        values = dtype_values(ids, dtype)
        if dtype == torch.bfloat16:  # numpy has no bfloat16: this field is always a tensor
            group0[dtype_key(dtype)] = torch.from_numpy(values).to(torch.bfloat16)
        elif as_numpy:
            group0[dtype_key(dtype)] = values
        else:
            group0[dtype_key(dtype)] = torch.from_numpy(values)
    chunk: Chunk = [group0]
    if groups == 2:
        g1 = _group1(ids)
        chunk.append(g1 if as_numpy else {k: torch.from_numpy(v) for k, v in g1.items()})
    return chunk


class AllDtypes(IterableDataset):  # type: ignore[type-arg]
    """One field per supported dtype, chunk sizes cycling through ``sizes``, optionally numpy and two groups."""

    def __init__(self, sizes: Sequence[int] = (1, 7, 33, 2, 16), as_numpy: bool = False, groups: int = 1) -> None:
        self.sizes = tuple(sizes)
        self.as_numpy = as_numpy
        self.groups = groups

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        n = wid * ID_STRIDE
        for size in itertools.cycle(self.sizes):
            ids = np.arange(n, n + size, dtype=np.int64)
            n += size
            yield dtype_chunk(ids, self.as_numpy, self.groups)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def check_dtype_batch(batch: Batch, bs: int, groups: int) -> np.ndarray:
    """Assert every field of an ``AllDtypes`` batch has its dtype, shape and exact value; return the ids."""
    assert len(batch) == groups
    group0 = batch[0]
    assert set(group0) == {"id", INDEX_KEY, *(dtype_key(d) for d in DTYPES)}
    ids = group0["id"].numpy().copy()
    assert group0["id"].dtype == torch.int64 and ids.shape == (bs,)
    for dtype in DTYPES:
        field = group0[dtype_key(dtype)]
        assert field.dtype == dtype, (dtype_key(dtype), field.dtype)
        assert field.shape == (bs,), (dtype_key(dtype), field.shape)
        np.testing.assert_array_equal(_as_numpy(field), dtype_values(ids, dtype), err_msg=dtype_key(dtype))
    if groups == 2:
        assert INDEX_KEY not in batch[1]
        expected = _group1(ids)
        assert set(batch[1]) == set(expected)
        assert batch[1]["grid"].dtype == torch.float32 and batch[1]["grid"].shape == (bs, 2, 3)
        assert batch[1]["pair"].dtype == torch.int64 and batch[1]["pair"].shape == (bs, 2)
        for key, want in expected.items():
            np.testing.assert_array_equal(batch[1][key].numpy(), want, err_msg=key)
    return ids


# -- bad input -------------------------------------------------------------------------------------------------


class DtypeChangesLater(IterableDataset):  # type: ignore[type-arg]
    """First chunk ``x`` float32, every later chunk ``x`` int64: the writer must refuse the second one."""

    def __iter__(self) -> Iterator[Chunk]:
        yield [{"x": torch.zeros(4, 2, dtype=torch.float32)}]
        while True:
            yield [{"x": torch.zeros(4, 2, dtype=torch.int64)}]


RAISE_TEXT = "dataset exploded on purpose: 7f3a91"


class RaisesInIter(IterableDataset):  # type: ignore[type-arg]
    """``iter(dataset)`` raises at once (not a generator), with a recognisable message."""

    def __iter__(self) -> Iterator[Chunk]:
        raise RuntimeError(RAISE_TEXT)


class OnlyEmptyChunks(IterableDataset):  # type: ignore[type-arg]
    """Endless chunks with zero rows."""

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            yield [{"x": torch.empty(0, 3, dtype=torch.float32)}]


class NoRows(IterableDataset):  # type: ignore[type-arg]
    """An ``__iter__`` that ends at once: the dataset of a file list or a glob that matched nothing."""

    def __iter__(self) -> Iterator[Chunk]:
        return iter(())


class UsesIndexKey(IterableDataset):  # type: ignore[type-arg]
    """A first group with a field named like the key the loader reserves for slot indices."""

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            yield [{INDEX_KEY: torch.zeros(4, dtype=torch.int64), "x": torch.zeros(4)}]


class Unpicklable(UniqueIds):
    """Holds a lock, which no pickler (cloudpickle included) can send to the writers."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


# -- helpers for the tests (not pickled) -----------------------------------------------------------------------

DEADLINE_S = startup_deadline(120.0, startups=60)  # a loader's start-up included
"""Generous per-wait deadline: the suite shares two cores with other jobs; nothing here asserts on speed."""


def take(it: Iterator[Batch], n: int, deadline_s: float = DEADLINE_S) -> list[Batch]:
    """``n`` batches from ``it``, failing (not hanging) when the deadline passes between batches."""
    deadline = time.monotonic() + deadline_s
    out: list[Batch] = []
    for _ in range(n):
        if time.monotonic() > deadline:
            raise TimeoutError(f"got only {len(out)} of {n} batches within {deadline_s}s")
        out.append(next(it))
    return out


def poll(it: Iterator[Batch], found: Any, what: str, deadline_s: float = DEADLINE_S) -> Batch:
    """Take batches until ``found(batch)`` is true; return that batch."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        batch = next(it)
        if found(batch):
            return batch
    raise TimeoutError(f"no batch showed {what} within {deadline_s}s")


def wait_for(predicate: Any, what: str, deadline_s: float = DEADLINE_S, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(interval_s)


# -- epochs (loader.set_epoch) ---------------------------------------------------------------------------------


class EpochEcho(IterableDataset):  # type: ignore[type-arg]
    """Rows carry ``epoch`` = the last ``set_epoch`` this writer's dataset took (``-1`` before any), per chunk, and
    ``pid``, the writer process's: a respawned writer's rows are told apart from its predecessor's still in the
    buffer."""

    def __init__(self, chunk: int = 4) -> None:
        self.chunk = chunk
        self.epoch = -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Chunk]:
        wid, _ = _worker()
        for n in itertools.count(0, self.chunk):
            ids = torch.arange(n, n + self.chunk, dtype=torch.int64) + wid * ID_STRIDE
            yield [
                {
                    "id": ids,
                    "epoch": torch.full((self.chunk,), self.epoch, dtype=torch.int64),
                    "pid": torch.full((self.chunk,), os.getpid(), dtype=torch.int64),
                }
            ]
