"""Unit tests of the benchmark code that does not need the loader: quality figures and baselines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from gigashuffle.tools import quality
from gigashuffle.tools.bench import options, runner
from gigashuffle.tools.bench.baselines import (
    CopyFloor,
    WorkerShuffleBuffer,
    copy_floor,
    dataloader_baseline,
    timed_batches,
)
from gigashuffle.tools.bench.cpu import CpuMeter
from gigashuffle.tools.bench.ranks import STEP_MS_VARIABLE, with_training_step
from gigashuffle.tools.bench.shapedfloor import Shape, ring_depth, shaped_floor, writers_lead
from gigashuffle.tools.bench.stamps import ChunkStamps
from gigashuffle.tools.bench.workloads import (
    ID_FIELD,
    WORKLOADS,
    FieldSpec,
    RepeatingChunkDataset,
    Workload,
    get_workload,
    make_ids,
)

SMALL = Workload(
    "small",
    (FieldSpec("x", torch.uint8, (3, 4, 4)), FieldSpec("y", torch.int64, ())),
    chunk_rows=8,
    bs=16,
    shuffle_size=128,
)


def _batches(ids: np.ndarray, bs: int) -> list[np.ndarray]:
    return [ids[i : i + bs] for i in range(0, len(ids), bs)]


# --------------------------------------------------------------------------------------- quality


def test_identity_order_has_zero_displacement() -> None:
    ids = make_ids(0, 0, 1000).numpy()
    q = quality.measure(_batches(ids, 100), shuffle_size=64)
    assert q.displacement == 0.0
    assert q.read_lag == 0.0
    assert q.slot_age == 0.0
    assert q.distinct_writers_per_batch == 1.0
    assert q.duplicate_fraction == 0.0
    assert q.rows == 1000 and q.batches == 10


def test_ideal_shuffle_has_ratio_about_one() -> None:
    shuffle_size = 500
    order = quality.simulate_ideal_buffer(100_000, shuffle_size, seed=1)
    q = quality.measure(_batches(order, 100), shuffle_size, seed=2)
    assert q.displacement_ratio == pytest.approx(1.0, abs=0.05)
    # Known figures of a uniform buffer: mean |displacement| ~ 2N/e, age ~ N.
    assert q.ideal_displacement == pytest.approx(2 * shuffle_size / np.e, rel=0.05)
    assert q.ideal_slot_age == pytest.approx(shuffle_size, rel=0.1)
    assert q.duplicate_fraction == 0.0


def test_simulated_ideal_buffer_matches_a_step_by_step_buffer() -> None:
    reads, size = 3000, 37
    slots = np.random.default_rng(5).integers(0, size, size=reads, dtype=np.int64)
    buffer, expected, next_row = list(range(size)), [], size
    for slot in slots:
        expected.append(buffer[slot])
        buffer[slot], next_row = next_row, next_row + 1
    np.testing.assert_array_equal(quality.simulate_ideal_buffer(reads, size, seed=5), expected)


def test_distinct_writers_per_batch() -> None:
    batch_a = np.concatenate([make_ids(w, 0, 4).numpy() for w in (0, 1, 2)])
    batch_b = make_ids(1, 10, 12).numpy()
    assert quality.distinct_writers_per_batch([batch_a, batch_b]) == 2.0
    assert quality.distinct_writers_per_batch([]) == 0.0


def test_write_positions_interleave_writers() -> None:
    ids = np.concatenate([make_ids(0, 0, 3).numpy(), make_ids(1, 0, 3).numpy()])
    np.testing.assert_array_equal(quality.write_positions(ids), [0, 2, 4, 1, 3, 5])


def test_uneven_writers_read_in_write_order_are_not_displaced() -> None:
    # Writer 0 writes three rows for each of writer 1's; rows are read in the order they were written (FIFO).
    fast, slow = make_ids(0, 0, 3_000).numpy(), make_ids(1, 0, 1_000).numpy()
    fifo = np.stack([fast[0::3], fast[1::3], fast[2::3], slow], axis=1).reshape(-1)
    q = quality.measure(_batches(fifo, 100), shuffle_size=64, num_writers=2)
    assert q.displacement < 2.0, q  # at most the estimate's rounding; assuming equal rates gave 1,000
    assert q.displacement_ratio < 0.1, q


def test_duplicates_are_counted() -> None:
    assert quality.duplicate_fraction(np.array([1, 1, 2, 3], dtype=np.int64)) == 0.25


# ------------------------------------------------------------------------------------- workloads


def test_workloads_match_the_issue() -> None:
    image, tokens, tiny = WORKLOADS["image"], WORKLOADS["tokens"], WORKLOADS["tiny"]
    assert (image.chunk_rows, image.bs, image.shuffle_size) == (64, 256, 4096)
    assert (tokens.chunk_rows, tokens.bs, tokens.shuffle_size) == (64, 64, 16384)
    assert (tiny.chunk_rows, tiny.bs, tiny.shuffle_size) == (1024, 1024, 65536)
    assert image.row_bytes == 3 * 224 * 224 + 8 + 8
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("nope")


def test_repeating_dataset_gives_fresh_ids_each_chunk() -> None:
    seen = [chunk[0][ID_FIELD].clone() for chunk in RepeatingChunkDataset(SMALL, max_chunks=3)]
    assert torch.equal(torch.cat(seen), torch.arange(3 * SMALL.chunk_rows))


# ------------------------------------------------------------------------------------- baselines


def test_copy_floor_gathers_batches_of_the_layout() -> None:
    floor = CopyFloor(SMALL)
    assert floor.step() == SMALL.bs
    assert floor.out["x"].shape == (SMALL.bs, 3, 4, 4) and floor.out["x"].dtype == torch.uint8
    assert floor.out[ID_FIELD].shape == (SMALL.bs,)
    assert int(floor.out[ID_FIELD].max()) < SMALL.shuffle_size
    rate = copy_floor(SMALL, seconds=10.0, max_batches=50)
    assert rate.batches == 50 and rate.samples == 50 * SMALL.bs
    assert rate.samples_per_s > 0 and rate.mb_per_s > 0
    threads = torch.get_num_threads()
    one = copy_floor(SMALL, seconds=10.0, max_batches=5, threads=1)
    assert one.batches == 5 and torch.get_num_threads() == threads, "the thread count is restored"


def test_worker_shuffle_buffer_emits_each_row_once() -> None:
    buffer = WorkerShuffleBuffer(RepeatingChunkDataset(SMALL), buffer_rows=64, bs=SMALL.bs)
    batches = iter(buffer)
    ids = []
    for _ in range(40):
        batch = next(batches)
        assert batch["x"].shape == (SMALL.bs, 3, 4, 4) and batch["y"].shape == (SMALL.bs,)
        ids.append(batch[ID_FIELD].numpy().copy())
    all_ids = np.concatenate(ids)
    assert quality.duplicate_fraction(all_ids) == 0.0
    # Rows only leave after the 64-row buffer filled, and none is newer than what was written.
    assert all_ids.max() < 64 + len(all_ids)


def test_dataloader_baseline_with_two_workers() -> None:
    run = dataloader_baseline(SMALL, seconds=10.0, num_workers=2, warmup_batches=2, max_batches=10)
    assert run.rate.batches == 10 and run.rate.samples_per_s > 0
    assert len(run.ids) == 12 and all(ids.shape == (SMALL.bs,) for ids in run.ids)
    q = quality.measure(run.ids, SMALL.shuffle_size, num_writers=2)
    assert q.duplicate_fraction == 0.0
    # A DataLoader batch is built inside one worker.
    assert q.distinct_writers_per_batch == 1.0


def test_shaped_floor_runs_the_loaders_processes() -> None:
    children_before = {p.pid for p in psutil.Process().children()}
    run = shaped_floor(SMALL, seconds=0.3, shape=Shape(writers=2, readers=1, ranks=2))
    assert {p.pid for p in psutil.Process().children()} == children_before, "every floor process was reaped"
    delivered, read, written = run.rows, run.rows_by_role["reader"], run.rows_by_role["writer"]
    assert delivered > 0 and delivered % SMALL.bs == 0
    # A reader's batches still in its ring at the deadline were read but not delivered: at most a ring per reader.
    assert delivered <= read <= delivered + 2 * ring_depth(SMALL) * SMALL.bs
    # Writers write one row per row read, ahead by the buffer's free share and the chunks in flight at most.
    assert 0 < written <= read + writers_lead(SMALL) + 4 * SMALL.chunk_rows
    assert all(spent > 0 for spent in run.cpu_s.values()), run.cpu_s
    out = run.to_dict()
    assert (out["writers"], out["readers"], out["ranks"]) == (2, 1, 2)
    assert out["samples_per_s"] == pytest.approx(delivered / 0.3)
    assert out["cpu_us_per_row"]["all"] == pytest.approx(1e6 * sum(run.cpu_s.values()) / delivered)


def test_chunk_stamps_give_each_row_its_chunks_time(tmp_path: Path) -> None:
    stamps = ChunkStamps(tmp_path, max_chunks=4)
    dataset = RepeatingChunkDataset(SMALL, max_chunks=5, stamps=stamps)  # one chunk more than the log holds
    before = time.monotonic_ns()
    chunks = [chunk[0][ID_FIELD].clone() for chunk in dataset]
    after = time.monotonic_ns()
    noted = np.fromfile(tmp_path / "writer-0.i64", dtype=np.int64)
    assert noted.size == 4 and before <= noted[0] and bool((np.diff(noted) >= 0).all()) and noted[-1] <= after
    ids = torch.cat(chunks[:4]).numpy()
    got = stamps.row_stamps(ids, SMALL.chunk_rows)
    assert got is not None and list(got) == list(np.repeat(noted, SMALL.chunk_rows))
    assert stamps.row_stamps(chunks[4].numpy(), SMALL.chunk_rows) is None, "a chunk past the log has no time"
    assert stamps.row_stamps(make_ids(1, 0, 3).numpy(), SMALL.chunk_rows) is None, "a writer that noted nothing"
    stamps.writer_log(2)  # a writer whose log exists but that noted no chunk yet
    assert stamps.row_stamps(make_ids(2, 0, 3).numpy(), SMALL.chunk_rows) is None


def test_timed_batches_always_times_one_batch() -> None:
    rate = timed_batches(lambda: 3, seconds=0.0, row_bytes=10)
    assert rate.batches == 1 and rate.samples == 3


# ---------------------------------------------------------------------------------------- runner


def _fake_result() -> runner.Result:
    rate = {
        "samples": 10,
        "batches": 2,
        "seconds": 1.0,
        "row_bytes": 8,
        "samples_per_s": 10.0,
        "mb_per_s": 8e-5,
    }
    qual = quality.measure(_batches(quality.simulate_ideal_buffer(200, 50), 20), 50).to_dict()
    loader = {
        **rate,
        "startup_s": 1.0,
        "import_torch_s": 2.0,
        "startup_vs_import_torch": 0.5,
        "warmup_batches": 1,
        "warmup_s": 0.1,
        "mixed": True,
        "redis_calls": 6,
        "redis_cmds_per_batch": 3.0,
        "cpu_us_per_row": {"writer": 1.0, "reader": 2.0, "trainer": 0.5, "zygote": 0.0, "redis": 0.25, "all": 3.75},
        "lock_busy": 0.375,
        "lock_hold_us": 41.5,
        "lock_holds_per_batch": 0.75,
        "lock_ns_per_row": 62.5,
        "lock_ceiling_rows_per_s": 16_000_000.0,
        "quality": qual,
        "children": [{"role": "writer", "pid": 1, "uss": 1 << 20, "pss": 1 << 20, "shared": 1 << 21}],
    }
    return {
        "workload": "small",
        "shuffle_size": 50,
        "seconds": 1.0,
        "torch_threads": 1,
        "num_writers": 1,
        "num_readers": 1,
        "ranks": 1,
        "min_mixing": 0.5,
        "loader": loader,
        "copy_floor": {**rate, "cpu_us_per_row": {"trainer": 0.5, "all": 0.5}, "one_thread_samples_per_s": 512.0},
        "dataloader": {**rate, "quality": qual},
        "loader_vs_floor": 1.0,
        "loader_vs_dataloader": 1.0,
        "shaped_floor": {
            **{"writers": 2, "readers": 2, "ranks": 1, "samples": 20, "seconds": 1.0, "samples_per_s": 20.0},
            "cpu_us_per_row": {"writer": 0.5, "reader": 0.75, "trainer": 0.25, "all": 1.5},
        },
        "loader_vs_shaped_floor": 0.5,
    }


def test_format_table_has_every_section() -> None:
    table = runner.format_table([_fake_result()])
    for needle in (
        "copy floor",
        "copy floor, 1 thread",
        "DataLoader",
        "loader/floor",
        "import torch",
        "USS",
        "cmds/batch",
        "quality",
        "CPU-us per delivered row",
    ):
        assert needle in table
    cpu_row = next(line for line in table.splitlines() if line.startswith("small") and "7.50x" in line)
    assert cpu_row.split()[1:7] == ["1.00", "2.00", "0.50", "0.00", "0.25", "3.75"], cpu_row  # all/floor = 3.75/0.5
    lock_lines = table.split("node lock over the timed window")[1].splitlines()
    assert lock_lines[2].split() == ["small", "37.5", "41.5", "0.75", "62.5", "16,000,000"], lock_lines
    shaped_lines = table.split("copy floor in the loader's shape")[1].splitlines()
    assert shaped_lines[2].split() == ["small", "2w+2r", "x1", "20", "0.50", "0.75", "0.25", "1.50", "0.50x"]


def test_format_table_shows_each_rank() -> None:
    result = _fake_result()
    loader = result["loader"]
    per_rank = [{"rank": r, **{k: loader[k] for k in ("samples", "batches", "seconds", "samples_per_s")},
                 "warmup_batches": 1, "warmup_s": 0.1, "mixed": True} for r in (0, 1)]  # fmt: skip
    result.update(num_writers=2, num_readers=2, ranks=2, loader={**loader, "ranks": 2, "per_rank": per_rank})
    table = runner.format_table([result])
    assert "2 writer(s) and 2 reader(s) per rank, 2 rank(s) on one node" in table
    assert "rows/s by trainer rank" in table
    assert "rows/s by trainer rank" not in runner.format_table([_fake_result()])


@pytest.mark.parametrize("option", ["--writers", "--readers", "--ranks"])
def test_scaling_options_need_a_positive_count(option: str) -> None:
    assert getattr(runner.build_parser().parse_args([option, "3"]), option[2:]) == 3
    with pytest.raises(SystemExit):
        runner.build_parser().parse_args([option, "0"])


def test_main_json_without_the_loader(capsys: pytest.CaptureFixture[str]) -> None:
    assert runner.main(["--workload", "tiny", "--seconds", "0.05", "--no-loader", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["workload"] == "tiny" and "loader" not in result
    assert result["copy_floor"]["samples_per_s"] > 0 and result["dataloader"]["samples_per_s"] > 0
    assert result["shaped_floor"]["samples_per_s"] > 0, "the shaped floor runs with the baselines"
    assert "loader_vs_shaped_floor" not in result


def test_stamps_place_bursty_writers_exactly() -> None:
    # Writer 0 writes alone for 1,000 rows, then writer 1 alone for 1,000, then both alternate: rows read in that
    # true write order (FIFO) are not displaced once the writers' time stamps place them, whatever the rates did.
    w0, w1 = make_ids(0, 0, 1_500).numpy(), make_ids(1, 0, 1_500).numpy()
    both = np.stack([w0[1_000:], w1[1_000:]], axis=1).reshape(-1)
    fifo = np.concatenate([w0[:1_000], w1[:1_000], both])
    stamps = np.arange(fifo.size, dtype=np.int64) * 10  # the time each row was stamped: strictly in write order
    batches, stamp_batches = _batches(fifo, 100), _batches(stamps, 100)
    exact = quality.measure(batches, shuffle_size=64, num_writers=2, stamps=stamp_batches)
    assert exact.displacement < 1.0, exact
    by_share = quality.measure(batches, shuffle_size=64, num_writers=2)
    assert by_share.displacement > 100, by_share  # equal shares in total, but not over time


def test_cpu_meter_takes_excluded_seconds_off_their_group() -> None:
    clock = {"trainer": 1.0, "reader": 5.0}
    meter = CpuMeter({group: [lambda group=group: clock[group]] for group in clock})
    meter.start()
    clock["trainer"] += 3.0
    clock["reader"] += 2.0
    meter.stop()
    assert meter.per_row_us(1_000_000) == {"trainer": 3.0, "reader": 2.0, "all": 5.0}
    # 1 s of the trainer's 3 s was the bench's bookkeeping: NOTE [ Bench bookkeeping ] in runner.py.
    assert meter.per_row_us(1_000_000, {"trainer": 1.0}) == {"trainer": 2.0, "reader": 2.0, "all": 4.0}


def test_quality_table_has_one_ideal_per_workload_and_a_legend_for_every_column() -> None:
    """Issue 25: two different "ideal" values sat under one header, and slot age, read lag's sign and warm-up were
    explained nowhere. Now the implementations share one ideal row, and a legend explains each column."""
    table = runner.format_table([_fake_result()])
    section = table.split("shuffle quality in rows")[1].split("\n\n")[0].splitlines()
    header, rows = section[1], section[2:]
    assert "ideal" not in header
    assert [row.split(",")[0].split()[1] for row in rows] == ["loader", "DataLoader", "ideal"]
    assert rows[0].split()[2:4] == ["1", "writers"] and rows[1].split()[2:4] == ["2", "workers"]
    legend = table.split("what the columns mean:")[1]
    for column in ("displacement", "ratio", "buffer fill", "slot age", "read lag", "writers/batch", "first 1k",
                   "dup %", "warm-up", "busy %"):  # fmt: skip
        assert f"\n  {column}" in legend or f" {column}:" in legend or f"; {column}" in legend, column
    assert "negative while a buffer" in legend  # the sign of read lag


def test_distinct_writers_over_the_first_thousand_batches() -> None:
    # 1,000 batches of one writer, then 500 batches of two: the start of the stream is told apart from the mean.
    one = [make_ids(0, 10 * i, 10).numpy() for i in range(1_000)]
    two = [np.concatenate([make_ids(0, 10_000 + 5 * i, 5).numpy(), make_ids(1, 5 * i, 5).numpy()]) for i in range(500)]
    q = quality.measure(one + two, shuffle_size=64, num_writers=2)
    assert q.distinct_writers_first_batches == 1.0
    assert q.distinct_writers_per_batch == pytest.approx(4 / 3)


def test_duplicate_fraction_counts_like_unique_over_writers_with_gaps() -> None:
    rng = np.random.default_rng(5)
    ids = np.concatenate([make_ids(w, 0, 1_000).numpy()[rng.integers(0, 1_000, 700)] for w in (0, 3, 7)])
    assert quality.duplicate_fraction(ids) == pytest.approx(1 - np.unique(ids).size / ids.size)


def test_the_light_parser_knows_every_workload() -> None:
    assert tuple(WORKLOADS) == options.WORKLOAD_NAMES


def test_elastic_bench_shards_hold_every_id_once_and_its_row_names_each_value(tmp_path: Path) -> None:
    from gigashuffle.sources.shards import PtReader
    from gigashuffle.tools.bench import elastic

    paths = elastic.make_shards(tmp_path, shards=3, rows=5)
    ids = torch.cat([PtReader()(p)[1](0, 5)[0]["id"] for p in paths])
    assert sorted(ids.tolist()) == list(range(15))
    names = ("size_mb", "saved_k", "reread_k", "load_state_dict_s", "first_batch_s")
    runs = [dict(zip(names, (1.25, 3.0, 0.0, 0.5, 1.0), strict=True)),
            dict(zip(names, (2.0, 5.0, 0.0, 0.25, 2.0), strict=True))]  # fmt: skip
    assert elastic._row("saved", 3, runs) == "| saved | 2 -> 3 | 1.2, 2.0 | 3-5 | 0-0 | 0.50, 0.25 | 1.00, 2.00 |"


def test_a_training_step_follows_each_timed_batch_and_cannot_be_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.build_parser().parse_args(["--step-ms", "2.5"]).step_ms == 2.5
    with pytest.raises(SystemExit):
        runner.build_parser().parse_args(["--step-ms", "-1"])
    calls: list[float] = []

    def step() -> int:
        calls.append(time.monotonic())
        return 4

    monkeypatch.setenv(STEP_MS_VARIABLE, "0")
    assert with_training_step(step) is step  # no step asked for: the loop is the bench's as before
    monkeypatch.setenv(STEP_MS_VARIABLE, "50")
    stepped = with_training_step(step)
    assert stepped() == 4 and stepped() == 4
    assert calls[1] - calls[0] >= 0.049, "the second batch came before the first one's training step was over"
