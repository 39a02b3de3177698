"""The human-readable report of ``gigashuffle bench``: one text table per concern, from :func:`.runner.run_workload`
results (plain dicts, so a JSON file of an earlier run can be formatted again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gigashuffle.tools.bench.options import DATALOADER_WORKERS, LEGEND

Result = dict[str, Any]
MIB = 1 << 20


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-align the first two columns (names), right-align the rest (numbers)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i < 2 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


_IMPLS = (("loader", "loader"), ("copy_floor", "copy floor"), ("dataloader", "DataLoader"))


def _throughput_table(results: Sequence[Result]) -> str:
    rows = []
    for res in results:
        for key, label in _IMPLS:
            if key not in res:
                continue
            ratios = ("", "")
            if key == "loader":
                ratios = (_times(res.get("loader_vs_floor")), _times(res.get("loader_vs_dataloader")))
            rate = res[key]
            rows.append([res["workload"], label, _num(rate["samples_per_s"]), _num(rate["mb_per_s"], 1), *ratios])
            one_thread = rate.get("one_thread_samples_per_s") if key == "copy_floor" else None
            if one_thread is not None:  # what one reader's gather (one thread) can reach at most
                mb_per_s = one_thread * rate["row_bytes"] / 1e6
                rows.append([res["workload"], "copy floor, 1 thread", _num(one_thread), _num(mb_per_s, 1), "", ""])
    return _table(["workload", "impl", "samples/s", "MB/s", "loader/floor", "loader/DataLoader"], rows)


_CPU_GROUPS = ("writer", "reader", "trainer", "zygote", "redis", "all")


def _loader_tables(results: Sequence[Result]) -> list[str]:
    loaders = [(res["workload"], res["loader"]) for res in results if "loader" in res]
    if not loaders:
        return []
    floor_cpu = {
        res["workload"]: res["copy_floor"]["cpu_us_per_row"].get("all") for res in results if "copy_floor" in res
    }
    startup = [
        [
            name,
            "",
            f"{ld['startup_s']:.2f} s",
            f"{ld['import_torch_s']:.2f} s",
            _times(ld["startup_vs_import_torch"]),
        ]
        for name, ld in loaders
    ]
    memory = [
        [
            name,
            child["role"],
            str(child.get("rank", 0)),
            str(child["pid"]),
            _num(child["uss"] / MIB, 1),
            _num(child["pss"] / MIB, 1),
            _num(child["shared"] / MIB, 1),
        ]
        for name, ld in loaders
        for child in ld["children"]
    ]
    cpu = [
        [
            name,
            "",
            *(_num(ld["cpu_us_per_row"].get(group), 2) for group in _CPU_GROUPS),
            _num(floor_cpu.get(name), 3),
            _times(ratio(ld["cpu_us_per_row"].get("all", 0.0), floor_cpu[name]) if floor_cpu.get(name) else None),
        ]
        for name, ld in loaders
    ]
    redis = [
        [
            name,
            "",
            _num(ld["redis_cmds_per_batch"], 2),
            str(ld["redis_calls"]),
            str(ld["batches"]),
            f"{ld['warmup_batches']} in {ld['warmup_s']:.2f} s" + ("" if ld["mixed"] else " (never mixed)"),
        ]
        for name, ld in loaders
    ]
    lock = [
        [
            name,
            "",
            _num(100 * ld["lock_busy"], 1) if ld.get("lock_busy") is not None else "-",
            _num(ld.get("lock_hold_us"), 1),
            _num(ld.get("lock_holds_per_batch"), 2),
            _num(ld.get("lock_ns_per_row"), 1),
            _num(ld.get("lock_ceiling_rows_per_s")),
        ]
        for name, ld in loaders
    ]
    sections = [
        "start-up (constructor to dummy batch) vs python -c 'import torch' (run at the same time as the start-up)\n"
        + _table(["workload", "", "loader", "import torch", "ratio"], startup),
        "loader children after the timed window (MiB)\n"
        + _table(["workload", "role", "rank", "pid", "USS", "PSS", "shared"], memory),
        "CPU-us per delivered row by process over the timed window (copy floor: one process gathering rows; the "
        "trainer's excludes the bench's copy of row ids for the quality figures)\n"
        + _table(["workload", "", *_CPU_GROUPS, "floor", "all/floor"], cpu),
        "Redis commands over the timed window (INFO commandstats)\n"
        + _table(["workload", "", "cmds/batch", "cmds", "batches", "warm-up"], redis),
        "node lock over the timed window (every transition of the node's writers and readers, summed over the slot "
        "table's stripes; busy near 100%: more of them cannot add throughput; ceiling = the node's rows/s with the "
        "busiest stripe's lock always held: 1 / lock time per row with one stripe)\n"
        + _table(["workload", "", "busy %", "us/hold", "holds/batch", "ns/row", "ceiling rows/s"], lock),
    ]
    if any(ld.get("lock_stripes", 1) > 1 for _, ld in loaders):
        stripes = [
            [name, str(ld.get("lock_stripes", 1)), _num(100 * (ld.get("lock_busiest_stripe_busy") or 0.0), 1)]
            for name, ld in loaders
        ]
        sections.append(
            "slot-table stripes (NOTE [ Stripes ] in shm/stripes.py): the busiest stripe's lock, which sets the "
            "ceiling\n" + _table(["workload", "stripes", "busiest busy %"], stripes)
        )
    if any(ld.get("ranks", 1) > 1 for _, ld in loaders):
        per_rank = [
            [
                name,
                str(rank["rank"]),
                _num(rank["samples_per_s"]),
                _num(rank["samples"]),
                f"{rank['seconds']:.2f} s",
                f"{rank['warmup_batches']} in {rank['warmup_s']:.2f} s" + ("" if rank["mixed"] else " (never mixed)"),
            ]
            for name, ld in loaders
            for rank in ld.get("per_rank", [])
        ]
        sections.insert(
            0,
            "loader rows/s by trainer rank (one node, one shared buffer; the loader row above is their sum)\n"
            + _table(["workload", "rank", "samples/s", "samples", "window", "warm-up"], per_rank),
        )
    return sections


def _shaped_floor_table(results: Sequence[Result]) -> str:
    rows = []
    for res in results:
        floor = res.get("shaped_floor")
        if not floor:
            continue
        per_row = floor["cpu_us_per_row"]
        rows.append(
            [
                res["workload"],
                f"{floor['writers']}w+{floor['readers']}r x{floor['ranks']}",
                _num(floor["samples_per_s"]),
                *(_num(per_row.get(role), 2) for role in ("writer", "reader", "trainer", "all")),
                _times(res.get("loader_vs_shaped_floor")),
            ]
        )
    title = (
        "copy floor in the loader's shape (its writers, readers and trainers copying and handing off batches; no "
        "slot table, lock or Redis): what this machine gives that many processes at all\n"
    )
    headers = ["workload", "shape", "samples/s", "writer", "reader", "trainer", "all", "loader/shaped"]
    return title + _table(headers, rows)


def _quality_row(workload: str, label: str, qual: dict[str, Any], fill: float | None, ideal: bool) -> list[str]:
    prefix = "ideal_" if ideal else ""
    return [
        workload,
        label,
        _num(qual[f"{prefix}displacement"]),
        _num(1.0 if ideal else qual["displacement_ratio"], 3),
        _num(fill, 2),
        _num(qual[f"{prefix}slot_age"]),
        _num(qual[f"{prefix}read_lag"]),
        "-" if ideal else _num(qual["distinct_writers_per_batch"], 2),
        "-" if ideal else _num(qual.get("distinct_writers_first_batches"), 2),
        "-" if ideal else _num(100 * qual["duplicate_fraction"], 2),
        _num(qual["rows"]),
    ]


def _quality_table(results: Sequence[Result]) -> str:
    rows = []
    for res in results:
        ideal = None
        for key, label in _IMPLS:
            qual = res.get(key, {}).get("quality")
            if not qual:
                continue
            estimated = qual.get("write_order") == "estimated"  # from the writers' shares: see bench/stamps.py
            sources = res["num_writers"] if key == "loader" else res[key].get("num_workers", DATALOADER_WORKERS)
            kind = "writers" if key == "loader" else "workers"
            name = f"{label}, {sources} {kind}" + (" (est.)" if estimated else "")
            rows.append(_quality_row(res["workload"], name, qual, res[key].get("mean_fill"), ideal=False))
            ideal = qual
        if ideal is not None:  # the same number of rows for every implementation: one ideal (NOTE [ One ideal ])
            label = f"ideal {res['shuffle_size']:,}-slot buffer"
            rows.append(_quality_row(res["workload"], label, ideal, 1.0, ideal=True))
    headers = ["workload", "impl", "displacement", "ratio", "buffer fill", "slot age", "read lag", "writers/batch",
               "first 1k", "dup %", "rows"]  # fmt: skip
    title = "shuffle quality in rows, over the same first rows of each implementation (see the legend below)\n"
    return title + _table(headers, rows)


def format_table(results: Sequence[Result] | Result) -> str:
    """The human-readable report of :func:`run_workload` results."""
    results = [results] if isinstance(results, dict) else list(results)
    if not results:
        return "no results"
    first = results[0]
    header = (
        f"gigashuffle bench: {first['num_writers']} writer(s) and {first['num_readers']} reader(s) per rank, "
        f"{first.get('ranks', 1)} rank(s) on one node, "
        f"min_mixing {first['min_mixing']}, {first['seconds']:g} s per measurement, "
        f"training step {first.get('step_ms', 0):g} ms, "
        f"torch threads {first['torch_threads']}, DataLoader {DATALOADER_WORKERS} workers"
    )
    sections = [header, _throughput_table(results), *_loader_tables(results)]
    if any("shaped_floor" in res for res in results):
        sections.append(_shaped_floor_table(results))
    if any(res.get(key, {}).get("quality") for res in results for key, _ in _IMPLS):
        sections.append(_quality_table(results))
    sections.append(LEGEND)
    return "\n\n".join(sections) + "\n"
