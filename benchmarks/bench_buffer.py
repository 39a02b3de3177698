"""The two copies the loader makes, each timed alone: ``SlotBuffer.gather`` (reader) and ``SlotBuffer.write`` (writer).

Every figure is CPU seconds per 1,000 rows, so lower is better, as asv assumes. No processes and no Redis: a change
in either copy shows up here without the noise of the rest of the loader. The buffers are built once per
benchmark process (asv re-runs ``setup`` before every sample, so it only looks them up).
"""

from __future__ import annotations

import time

import torch

from gigashuffle.schema import Layout
from gigashuffle.shm.buffer import BatchRing, SlotBuffer
from gigashuffle.tools.bench.workloads import WORKLOADS

# Readers and writers run with one intra-op thread (procs/childenv.py); a second thread would also make every sample
# wait for whichever thread the scheduler delayed, which on a shared machine is most of the spread.
torch.set_num_threads(1)

ROWS = 1_000
# (slots in the buffer, rows per gather) for each workload. The buffer and the ring are kept to a few MB, so they
# stay in the CPU caches: then a sample measures the copy code, not the memory traffic of the machine's other
# tenants. With a real 150 MB image buffer here, medians moved 17.6-22.4 ms between processes of one unchanged
# tree on a loaded host (an unchanged commit was once "slower" by 23%); with 64 slots, 11.57-11.73 ms. The
# bandwidth-bound case of a full-size buffer is what `gigashuffle bench` measures.
SIZES = {"image": (64, 16), "tokens": (1_024, 64), "tiny": (65_536, 1_024)}
WORKLOAD_NAMES = list(SIZES)


class _Fixture:
    """A filled buffer of one workload, the batches of 1,000 random slots to gather, and ring memory for them."""

    def __init__(self, name: str) -> None:
        workload = WORKLOADS[name]
        slots, bs = SIZES[name]
        rows = workload.chunk_rows
        chunk = [workload.make_chunk()]
        self.layout = Layout.from_chunk(chunk)
        _, self.chunk_rows = self.layout.rows_in(chunk)
        self.buffer = SlotBuffer(self.layout, slots)
        for start in range(0, slots, rows):
            self.buffer.write(torch.arange(start, start + rows), self.chunk_rows, 0)
        # Random permutations of the slots, one after another: every batch (bs divides slots) and every chunk
        # (chunk_rows divides slots) holds distinct slots, as the Redis state machine hands them out.
        generator = torch.Generator().manual_seed(0)
        order = torch.cat([torch.randperm(slots, generator=generator) for _ in range(-(-ROWS // slots))])[:ROWS]
        # A reader gathers batches of bs slots into its ring's shared memory: 1,000 rows as full batches plus
        # one partial batch.
        self.ring = BatchRing(self.layout, bs, depth=1)
        fields, _ = self.ring.regions(0)
        self.gathers = [(order[s : s + bs], [f[: len(order[s : s + bs])] for f in fields]) for s in range(0, ROWS, bs)]
        # A writer copies whole chunks into the empty slots it was given.
        self.writes = [order[s : s + rows] for s in range(0, ROWS, rows)]


_FIXTURES: dict[str, _Fixture] = {}


def _fixture(name: str) -> _Fixture:
    if name not in _FIXTURES:
        _FIXTURES[name] = _Fixture(name)
    return _FIXTURES[name]


class Gather:
    """``SlotBuffer.gather`` of 1,000 random full slots into a reader ring, in batches (see ``SIZES``)."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    # Samples from four processes per commit, which asv continuous interleaves between the two commits, so that
    # a change of load on the machine while it runs falls on both commits alike.
    rounds = 4
    repeat = (10, 50, 4.0)
    warmup_time = 0.2
    # One thread doing CPU work: its CPU time is what the copy costs, and unlike wall time it does not grow when
    # the scheduler hands the core to another job (on a loaded 2-core machine the interquartile range of the
    # image gather of a 150 MB buffer was 17-34 ms wall, 19-21 ms CPU).
    timer = time.process_time
    timeout = 300

    def setup(self, workload: str) -> None:
        self.fixture = _fixture(workload)

    def time_gather_1000_rows(self, workload: str) -> None:
        buffer = self.fixture.buffer
        for ids, out in self.fixture.gathers:
            buffer.gather(ids, out)


class Write:
    """``SlotBuffer.write`` of 1,000 rows as whole chunks into random empty slots, as a writer does."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    rounds = 4  # see Gather
    repeat = (10, 50, 4.0)
    warmup_time = 0.2
    timer = time.process_time  # see Gather
    timeout = 300

    def setup(self, workload: str) -> None:
        self.fixture = _fixture(workload)

    def time_write_1000_rows(self, workload: str) -> None:
        buffer, rows = self.fixture.buffer, self.fixture.chunk_rows
        for ids in self.fixture.writes:
            buffer.write(ids, rows, 0)
