"""The ``gigashuffle`` command as a user runs it: a real process each time, against real loaders and servers."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from datasets import UniqueIds

import gigashuffle
from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.control.client import connect
from gigashuffle.promtext import SAMPLE_LINE
from gigashuffle.tools.stats import queue_rows

HEAVY = ("torch", "numpy", "redis")


def cli(*args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gigashuffle.tools.cli ARGS``; GIGASHUFFLE_REDIS_URL is dropped: the defaults are tested."""
    environ = {k: v for k, v in os.environ.items() if k != "GIGASHUFFLE_REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "gigashuffle.tools.cli", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False, env={**environ, **(env or {})},
    )  # fmt: skip


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from ``python -X importtime`` output (``import time: self | cumulative | name`` lines)."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header line
                names.add(name)
    return names


@pytest.mark.parametrize(
    "args", [["--help"], ["stats", "--help"], ["--version"], ["demo", "--help"], ["bench", "--help"]]
)
def test_help_imports_nothing_heavy(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gigashuffle.tools.cli", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    modules = imported_modules(done.stderr)
    assert "gigashuffle._version" in modules  # the check sees the package's own imports, so it would see torch
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"`gigashuffle {' '.join(args)}` imported {heavy[:10]}"


def test_help_lists_the_commands_and_version_is_the_package_version() -> None:
    done = cli("--help")
    assert done.returncode == 0
    for command in ("demo", "stats", "bench"):
        assert f"    {command}" in done.stdout
    version = cli("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"gigashuffle {gigashuffle.__version__}")


def test_no_command_prints_help_and_fails() -> None:
    done = cli()
    assert done.returncode == 2
    assert "usage: gigashuffle" in done.stderr and "stats" in done.stderr


def test_subcommands_answer_their_own_help() -> None:
    done = cli("demo", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: gigashuffle demo" in done.stdout and "--seconds" in done.stdout
    assert "``" not in done.stdout  # no reST markup from a docstring
    bench = cli("bench", "--help")
    assert bench.returncode == 0, bench.stderr
    assert "usage: gigashuffle bench" in bench.stdout and "pip install 'gigashuffle[bench]'" in bench.stdout
    assert "what the columns mean:" in bench.stdout and "slot age" in bench.stdout


def test_bench_without_its_extra_says_what_to_install_in_one_line() -> None:
    """After the README's install (no psutil) the bench died after 16 s with a ModuleNotFoundError traceback."""
    hide_psutil = (
        "import sys; sys.modules['psutil'] = None; from gigashuffle.tools.cli import main; "
        "sys.exit(main(['bench', '--workload', 'tiny', '--seconds', '1']))"
    )
    done = subprocess.run([sys.executable, "-c", hide_psutil], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == ["gigashuffle bench needs psutil: pip install 'gigashuffle[bench]'"]


def test_bench_json_through_the_command() -> None:
    done = cli("bench", "--workload", "tiny", "--seconds", "0.05", "--no-loader", "--json", "--log-level", "WARNING")
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads(done.stdout)
    assert result["workload"] == "tiny"
    assert result["copy_floor"]["samples_per_s"] > 0


def test_bench_two_ranks_of_one_node_share_a_buffer(runtime_dir: Path) -> None:
    """--ranks 2: rank 1 is a process of its own on the embedded server rank 0 started, and both deliver rows."""
    done = cli(
        "bench", "--workload", "tiny", "--seconds", "0.5", "--no-baselines", "--ranks", "2", "--writers", "1", "--json",
        "--log-level", "WARNING", timeout_s=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)
    assert (result["num_writers"], result["num_readers"], result["ranks"]) == (1, 1, 2)
    loader = result["loader"]
    per_rank = loader["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    assert all(r["samples"] > 0 and r["samples_per_s"] > 0 for r in per_rank), per_rank
    assert loader["samples"] == sum(r["samples"] for r in per_rank)
    assert loader["samples_per_s"] == pytest.approx(sum(r["samples_per_s"] for r in per_rank))
    # Sampled every 32 batches of rank 0 in the window: a share of the node's slots.
    assert loader["mean_fill"] is not None and 0.0 < loader["mean_fill"] <= 1.0, loader["mean_fill"]
    # CPU is metered over every process of both ranks: each rank's writer and reader, and both trainers.
    assert {"writer", "reader", "trainer", "zygote", "redis", "all"} <= loader["cpu_us_per_row"].keys()
    # Rank 0's copy of row ids for the quality figures is metered on its own and is not the trainer's.
    assert loader["bench_recording_us_per_row"] > 0.0, loader["bench_recording_us_per_row"]
    assert loader["cpu_us_per_row"]["trainer"] > 0.0
    # The node lock over the window, every rank's writers and readers together (NOTE [ Node lock budget ]).
    assert loader["lock_holds_per_batch"] > 0.0 and loader["lock_hold_us"] > 0.0, loader
    assert 0.0 < loader["lock_busy"] <= 1.0, loader["lock_busy"]
    assert {(c["rank"], c["role"]) for c in loader["children"]} >= {
        (r, role) for r in (0, 1) for role in ("writer", "reader")
    }


def test_bench_two_writers_place_rows_by_their_write_times() -> None:
    """With two writers the interleaving of their rows is read from their chunk times, not estimated; and the copy
    floor runs in the loader's shape right after it."""
    done = cli(
        "bench", "--workload", "tiny", "--seconds", "0.5", "--no-baselines", "--shaped-floor", "--writers", "2",
        "--readers", "2", "--json", "--log-level", "WARNING", timeout_s=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)
    shuffle = result["loader"]["quality"]
    assert shuffle["write_order"] == "stamped", shuffle
    assert shuffle["duplicate_fraction"] == 0.0 and 1.0 <= shuffle["distinct_writers_per_batch"] <= 2.0, shuffle
    # Estimated from the writers' shares, such runs gave up to 2.3 ("mixed better than an ideal buffer").
    assert 0.0 < shuffle["displacement_ratio"] < 1.5, shuffle
    floor = result["shaped_floor"]
    assert (floor["writers"], floor["readers"], floor["ranks"]) == (2, 2, 1)
    assert floor["samples_per_s"] > 0 and result["loader_vs_shaped_floor"] > 0, floor


def test_stats_lists_each_queue_with_counts_ranks_and_rates(redis_url: str) -> None:
    config = DataloaderConfig(
        bs=8, shuffle_size=128, queue_name="cli-stats", num_writers=1, num_readers=1, redis_url=redis_url
    )
    stop = threading.Event()
    read = []
    with MultiprocessShuffledDataloader(UniqueIds(), config) as loader:
        batches = iter(loader)
        read.append(next(batches))  # the buffer exists and readers run before we look

        def consume() -> None:
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                next(batches)
                read.append(None)

        consumer = threading.Thread(target=consume)
        consumer.start()
        client = connect(redis_url)
        try:
            rows = queue_rows(client, interval_s=0.5)
            # The lock's share needs two heartbeat readings of a mapped table between the samples; the first
            # sample may come before the trainer's first one.
            deadline = time.monotonic() + 30
            lock_rows = rows
            while lock_rows[0]["lock_busy_pct"] is None and time.monotonic() < deadline:
                lock_rows = queue_rows(client, interval_s=0.5)
        finally:
            stop.set()
            consumer.join(timeout=60)
            client.close()
        listed_by_url = cli("stats", "--redis", redis_url, "--json", "--interval", "0")
        legacy_flag = cli("stats", "--redis-url", redis_url, "--interval", "0")
        prometheus = cli("stats", "--redis", redis_url, "--prometheus", "--interval", "0")
    assert not consumer.is_alive()
    (row,) = rows
    assert (row["queue"], row["node"], row["size"], row["ranks"]) == ("cli-stats", "n0", 128, 1)
    assert row["full"] + row["empty"] + row["in_flight"] == 128
    assert row["processes"] == 2
    assert row["read_per_s"] > 0 and row["written_per_s"] > 0, row
    busy = lock_rows[0]["lock_busy_pct"]
    assert busy is not None and 0.0 < busy <= 100.0, lock_rows  # the lock was taken while batches flowed
    assert listed_by_url.returncode == 0, listed_by_url.stderr
    (listed,) = json.loads(listed_by_url.stdout)
    assert listed["queue"] == "cli-stats" and listed["server"] == redis_url
    assert isinstance(listed["read_per_s"], int)  # --interval 0 waits for nothing: the records were there
    assert legacy_flag.returncode == 0, legacy_flag.stderr
    header, line = legacy_flag.stdout.splitlines()
    assert header.split() == ["queue", "node", "size", "full", "empty", "in_flight", "ranks", "processes",
                              "written_per_s", "read_per_s", "lock_busy_pct", "generation"]  # fmt: skip
    assert line.split()[:3] == ["cli-stats", "n0", "128"]
    assert prometheus.returncode == 0, prometheus.stderr
    _check_prometheus_text(prometheus.stdout)
    where = f'{{server="{redis_url}",queue="cli-stats",node="n0"}}'
    assert f"gigashuffle_buffer_slots{where} 128.0" in prometheus.stdout.splitlines()
    (rate,) = (line for line in prometheus.stdout.splitlines() if line.startswith("gigashuffle_node_rows_per_second"))
    assert float(rate.rsplit(" ", 1)[1]) > 0, rate


def _check_prometheus_text(text: str) -> None:
    """Every line a comment or a sample a scraper accepts; every family with one HELP and one TYPE."""
    assert text.endswith("\n")
    names = set()
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            names.add(line.split()[2])
        else:
            assert SAMPLE_LINE.match(line), line
            assert line.split("{", 1)[0].split(" ", 1)[0] in names, line
    for name in names:
        assert sum(line.startswith((f"# HELP {name} ", f"# TYPE {name} ")) for line in text.splitlines()) == 2


def test_stats_finds_every_node_embedded_server_and_watches(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GIGASHUFFLE_REDIS_URL", raising=False)
    common = {"bs": 4, "shuffle_size": 64, "queue_name": "cli-nodes", "num_writers": 1, "num_readers": 1}
    node0 = DataloaderConfig(**common)
    node1 = DataloaderConfig(**common, global_rank=1, global_world_size=2)  # one rank per node: node n1
    with (
        MultiprocessShuffledDataloader(UniqueIds(), node0) as loader0,
        MultiprocessShuffledDataloader(UniqueIds(), node1) as loader1,
    ):
        next(iter(loader0))  # both buffers exist before we look
        next(iter(loader1))
        once = cli("stats", "--json", "--interval", "0")
        watched = cli("stats", "--json", "--watch", "0.2", "--count", "3")
        table = cli("stats", "--watch", "0.2", "--count", "2")
    sockets = {f"unix://{runtime_dir / 'redis-n0.sock'}", f"unix://{runtime_dir / 'redis-n1.sock'}"}

    assert once.returncode == 0, once.stderr
    rows = json.loads(once.stdout)
    assert sorted((r["queue"], r["node"], r["size"]) for r in rows) == [
        ("cli-nodes", "n0", 64),
        ("cli-nodes", "n1", 64),
    ]
    assert {r["server"] for r in rows} == sockets

    assert watched.returncode == 0, watched.stderr
    frames = [json.loads(line) for line in watched.stdout.splitlines()]
    assert len(frames) == 3
    assert all(len(frame) == 2 for frame in frames)
    # Rates come from the nodes' own counter records (NOTE [ Stats rates ]), so every frame that has two has them.
    assert all(isinstance(r["read_per_s"], int) and isinstance(r["written_per_s"], int) for r in frames[2])

    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    headers = [line for line in lines if line.startswith("gigashuffle stats")]
    assert len(headers) == 2
    assert all(socket_url in headers[0] for socket_url in sockets)
    assert sum(line.split()[:2] == ["cli-nodes", "n1"] for line in lines) == 2


class ThrottledConsumer:
    """Reads batches at a steady, throttled pace in a thread, noting the rows it got and when."""

    def __init__(self, loader: MultiprocessShuffledDataloader, pause_s: float, deadline_s: float = 120.0) -> None:
        self.rows = 0
        self._pause = pause_s
        self.marks: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._batches = iter(loader)
        self._deadline = time.monotonic() + deadline_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            batch = next(self._batches)
            self.rows += len(batch[0]["id"])
            self.marks.append((time.monotonic(), self.rows))
            self._stop.wait(self._pause)

    def rate_since(self, start: float) -> float:
        """Rows per second delivered since ``start`` (monotonic), up to now."""
        mine = [(t, n) for t, n in self.marks if t >= start]
        assert len(mine) >= 2, "the consumer read nothing in the window"
        return (mine[-1][1] - mine[0][1]) / (mine[-1][0] - mine[0][0])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()


def test_stats_rates_match_the_delivered_rate_once_and_watched(redis_url: str) -> None:
    """Issue 25: one-shot runs printed 28K, 0, 28K... and --watch 1 alternated ~28K and 0 for a loader at 14K
    rows/s, sampling over their own interval while the counters move every 2 s. Every figure must now sit near the
    rate the trainer really got, and none be 0 while rows flow."""
    config = DataloaderConfig(
        bs=16, shuffle_size=256, queue_name="cli-rates", num_writers=1, num_readers=1, redis_url=redis_url
    )
    with MultiprocessShuffledDataloader(UniqueIds(), config) as loader:
        consumer = ThrottledConsumer(loader, pause_s=0.01)  # at most 1,600 rows/s: far below the loader's, so steady
        try:
            deadline = time.monotonic() + 120
            while not consumer.rows and time.monotonic() < deadline:  # rows flow: the first seconds of a job
                time.sleep(0.05)
            start = time.monotonic()
            once = [cli("stats", "--redis", redis_url, "--json") for _ in range(3)]
            watched = cli("stats", "--redis", redis_url, "--json", "--watch", "0.7", "--count", "6")
            delivered = consumer.rate_since(start)
        finally:
            consumer.stop()
    figures = []
    for done in [*once, watched]:
        assert done.returncode == 0, done.stderr
        for line in done.stdout.splitlines() if done is watched else [done.stdout]:
            (row,) = json.loads(line)
            figures.append(row["read_per_s"])
    assert len(figures) == 3 + 6
    # Tolerant: each figure is a 2 s window of a rate that load may bend; the old bug gave 0 and twice the rate.
    assert all(f is not None and 0.5 * delivered < f < 1.7 * delivered for f in figures), (delivered, figures)


def test_stats_lists_a_queue_from_the_first_second_of_a_job(redis_url: str) -> None:
    """Before the buffer exists (no ``meta`` key yet) the queue is listed: the first trainer's join made it."""
    config = DataloaderConfig(bs=4, shuffle_size=64, queue_name="cli-early", num_writers=1, num_readers=1,
                              redis_url=redis_url)  # fmt: skip
    client = connect(redis_url)
    try:
        with MultiprocessShuffledDataloader(UniqueIds(), config):
            early = cli("stats", "--redis", redis_url, "--interval", "0")
            rows = queue_rows(client, interval_s=0)
    finally:
        client.close()
    assert early.returncode == 0, early.stderr
    assert "(no gigashuffle queues on this server)" not in early.stdout
    assert [line.split()[:2] for line in early.stdout.splitlines()[1:]] == [["cli-early", "n0"]]
    assert [(r["queue"], r["ranks"]) for r in rows] == [("cli-early", 1)]


def test_stats_lines_fit_a_terminal(redis_url: str) -> None:
    """The generation is shown by its first characters: a 73-character column made 190-character lines."""
    config = DataloaderConfig(bs=4, shuffle_size=64, queue_name="cli-width", num_writers=1, num_readers=1,
                              redis_url=redis_url)  # fmt: skip
    with MultiprocessShuffledDataloader(UniqueIds(), config) as loader:
        next(iter(loader))
        done = cli("stats", "--redis", redis_url, "--interval", "0")
        generation = loader._sup.session.generation
    assert done.returncode == 0, done.stderr
    header, line = done.stdout.splitlines()
    assert max(len(header), len(line)) <= 120, done.stdout
    assert line.split()[-1] == generation.rpartition("/")[2][:8]


def _refused_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"  # nothing listens once the probe is closed


@pytest.mark.parametrize("where", ["refused port", "missing socket"])
def test_unreachable_server_is_one_line_and_an_exit_code(where: str, tmp_path: Path) -> None:
    url = _refused_url() if where == "refused port" else f"unix://{tmp_path / 'none.sock'}"
    done = cli("stats", "--redis", url, "--timeout", "1")
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"gigashuffle stats: Redis at {url} failed: ")
    assert "Traceback" not in done.stderr
    assert "--timeout" in line


def test_no_embedded_server_is_one_line(runtime_dir: Path) -> None:
    done = cli("stats", env={"GIGASHUFFLE_RUNTIME_DIR": str(runtime_dir)})
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert f"no embedded gigashuffle server answers in {runtime_dir}" in line
    assert "--redis URL" in line


def test_prometheus_without_a_server_is_an_empty_exposition(runtime_dir: Path) -> None:
    # A scraper (node_exporter's textfile collector, a cron job) runs this whether or not a loader runs.
    done = cli("stats", "--prometheus", env={"GIGASHUFFLE_RUNTIME_DIR": str(runtime_dir)})
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    _check_prometheus_text(done.stdout)
    lines = done.stdout.splitlines()
    assert "# TYPE gigashuffle_buffer_slots gauge" in lines, done.stdout
    assert all(line.startswith("#") for line in lines), done.stdout  # no samples: no queue, no node


def test_watch_follows_a_server_that_stops_and_ends_on_ctrl_c(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GIGASHUFFLE_REDIS_URL", raising=False)
    config = DataloaderConfig(bs=4, shuffle_size=64, queue_name="cli-gone", num_writers=1, num_readers=1)
    environ = {k: v for k, v in os.environ.items() if k != "GIGASHUFFLE_REDIS_URL"}
    lines: queue.Queue[str] = queue.Queue()

    def next_frame(deadline: float) -> list[dict[str, object]]:
        try:
            frame: list[dict[str, object]] = json.loads(lines.get(timeout=max(deadline - time.monotonic(), 0)))
        except queue.Empty:
            pytest.fail("no frame from `gigashuffle stats --watch` before the deadline")
        return frame

    loader = MultiprocessShuffledDataloader(UniqueIds(), config)
    watch = None
    try:
        next(iter(loader))
        watch = subprocess.Popen(
            [sys.executable, "-m", "gigashuffle.tools.cli", "stats", "--watch", "0.1", "--json", "--interval", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
        )  # fmt: skip
        reader = threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout], daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        assert [r["queue"] for r in next_frame(deadline)] == ["cli-gone"]
        loader.close()  # the last loader of the node: its embedded server stops
        while next_frame(deadline):
            pass  # frames until the watch sees the server gone
        watch.send_signal(signal.SIGINT)
        _, stderr = watch.communicate(timeout=60)
    finally:
        loader.close()
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait(timeout=60)
    assert watch.returncode == 0, stderr
    assert stderr == ""


def test_watch_without_a_server_waits_for_one(runtime_dir: Path) -> None:
    # Embedded servers come and go with their loaders: a watch keeps looking, as top does for processes.
    done = cli("stats", "--watch", "0.1", "--count", "2", env={"GIGASHUFFLE_RUNTIME_DIR": str(runtime_dir)})
    assert done.returncode == 0, done.stderr
    headers = [line for line in done.stdout.splitlines() if line.startswith("gigashuffle stats")]
    assert len(headers) == 2
    assert all(f"no embedded gigashuffle server answers in {runtime_dir}" in h for h in headers)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--watch", "0"], 1, "--watch 0 is invalid"),
        (["--count", "0", "--watch"], 1, "--count 0 is invalid"),
        (["--redis", "localhost:6379"], 1, "--redis 'localhost:6379' is invalid: use redis://"),
        (["--bogus"], 2, "unrecognized arguments: --bogus"),
        (["--json", "--prometheus"], 2, "not allowed with argument"),
    ],
)
def test_bad_stats_arguments(args: list[str], code: int, message: str) -> None:
    done = cli("stats", *args, timeout_s=60)
    assert done.returncode == code
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_demo_runs_a_real_loader_and_reports_what_it_did() -> None:
    """The README's first command: a real loader on the embedded server, and a report whose figures add up."""
    done = cli("demo", "--seconds", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    # stderr is a pipe here: plain progress lines, no bar redrawn with carriage returns.
    assert "\r" not in done.stderr and "filling shuffle buffer: " in done.stderr, done.stderr[-2000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.strip()}
    batches, samples = (int(word.strip("(")) for word in lines["read"].split()[1:4:2])
    assert batches > 0 and samples == 64 * batches, lines["read"]
    quality = lines["shuffle"]
    assert "0.0% samples read twice" in quality, quality
    ratio = float(quality.split("(ratio ")[1].split(")")[0])
    # Rows placed in the write stream by their writers' time stamps: a uniform sampler over at most 4,096 slots
    # cannot move rows further than the ideal 4,096-slot buffer does, nor (at least half full) keep them in order.
    assert 0.2 < ratio < 1.5, quality
