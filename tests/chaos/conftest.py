"""The chaos suite's harness: one ``chaos`` fixture per test, plus the run report.

Each test calls ``chaos.begin(...)`` (which takes the leak snapshot), builds its loaders through
``chaos.loader(...)``, injects its fault, and ends with ``chaos.finish(...)``, which closes every loader and
asserts that nothing leaked (tests/leaks.py): no /dev/shm entry or semaphore named like gigashuffle, no new fd
of this process, no live descendant, no socket file in the test's runtime dir, no Redis key of the queue.

Every test appends one JSON line to ``$GIGASHUFFLE_CHAOS_REPORT`` (default /tmp/gigashuffle-chaos-report.jsonl):
scenario, case, seed, outcome, the measured detection time and the leak figures. The controlling pytest process
turns the records into a Markdown table next to it (same name, ``.md``) when the session ends.

Nothing here waits without a deadline: ``deadline()`` bounds a call in the main thread with SIGALRM (restoring
pytest-timeout's own timer afterwards), ``wait_until`` polls with one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import leaks
import psutil
import pytest
import redis
from chaos_datasets import check_batch, writer_of
from redis_servers import wait_until
from slot_audit import audit_slots, node_table, snapshot
from timing import deadline, startup_deadline

from gigashuffle import DataloaderConfig, MultiprocessShuffledDataloader
from gigashuffle.control.keys import QueueKeys

REPORT_ENV = "GIGASHUFFLE_CHAOS_REPORT"
DEFAULT_REPORT = "/tmp/gigashuffle-chaos-report.jsonl"
# Buffers and rings are anonymous memfds (no /dev/shm name); anything named like us there would be a leak. Other
# engineers' jobs share /dev/shm, so a wider pattern would count their files as ours.
SHM_PATTERN = "*gigashuffle*"
LEAK_FIELDS = ("shm", "semaphores", "fds", "children", "sockets", "redis_keys", "mappings")
TRAINER_SCRIPT = Path(__file__).with_name("trainer_script.py")
# One next() call, zygote start-up (an interpreter plus import torch) and the children's attach included.
NEXT_TIMEOUT_S = startup_deadline(60.0, startups=30)


RUN_ENV = "GIGASHUFFLE_CHAOS_RUN"


def report_path() -> Path:
    return Path(os.environ.get(REPORT_ENV, DEFAULT_REPORT))


def run_id() -> str:
    """Which pytest run a record belongs to: set once by the controller, inherited by xdist workers.

    Runs append to one report and never truncate it, so a second pytest started while a first one is still
    going (or after it) adds its lines beside the first one's instead of wiping them.
    """
    if RUN_ENV not in os.environ:
        os.environ[RUN_ENV] = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    return os.environ[RUN_ENV]


# -- bounded waits -------------------------------------------------------------------------------------------
def process_gone(pid: int, create_time: float) -> bool:
    """True once ``pid`` no longer runs (exited, reaped or a zombie, or the pid now names another process)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() != create_time or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- Redis views -------------------------------------------------------------------------------------------
class FreshScan:
    """A ``scan_iter`` for leak snapshots that opens and closes its own connection on every call.

    A long-lived client would hold a socket across a Redis restart and reconnect on a new fd, which the fd
    accounting would report as a leak; a fresh one is closed before the snapshot lists the fds.
    """

    def __init__(self, url: str | None) -> None:
        self.url = url

    def scan_iter(self, match: str, count: int) -> list[bytes]:
        if self.url is None:
            return []
        with redis.Redis.from_url(self.url, socket_timeout=5.0, socket_connect_timeout=2.0) as client:
            return list(client.scan_iter(match=match, count=count))


# -- iteration ---------------------------------------------------------------------------------------------
class Consumer:
    """The trainer side: next() with a deadline, every batch checked, ids collected."""

    def __init__(self, loader: MultiprocessShuffledDataloader) -> None:
        self.loader = loader
        self.config = loader.config
        self.iterator = iter(loader)
        self.ids: list[int] = []
        self.batches = 0
        self.in_next_since: float | None = None
        self.waits: list[tuple[float, float]] = []  # (when next() was called, how long it took)

    def next(self, timeout_s: float = NEXT_TIMEOUT_S) -> list[int]:
        with deadline(timeout_s, "next() on the loader"):
            called = self.in_next_since = time.monotonic()
            try:
                batch = next(self.iterator)
            finally:
                self.in_next_since = None
        self.waits.append((called, time.monotonic() - called))
        ids = check_batch(batch, self.config.bs, self.config.shuffle_size)
        del batch  # the ring slot goes back to its reader
        self.ids.extend(ids)
        self.batches += 1
        return ids

    def take(self, n: int, timeout_s: float = NEXT_TIMEOUT_S) -> None:
        for _ in range(n):
            self.next(timeout_s)

    def writers_seen(self) -> set[int]:
        return {writer_of(i) for i in self.ids}

    def assert_unique(self) -> None:
        seen: set[int] = set()
        dups = [i for i in self.ids if i in seen or seen.add(i)]  # type: ignore[func-returns-value]
        assert not dups, f"{len(dups)} ids were read twice (first: {dups[:5]}); a slot was handed out twice"


class Worker(threading.Thread):
    """A helper thread (a killer, a prober) whose exception the main thread re-raises on ``result()``."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.error_text = ""

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc
            self.error_text = traceback.format_exc()

    def result(self, timeout_s: float = 60.0) -> Any:
        self.join(timeout_s)
        if self.is_alive():
            raise AssertionError(f"thread {self.name} did not finish within {timeout_s} s")
        if self.error is not None:
            raise AssertionError(f"thread {self.name} failed:\n{self.error_text}") from self.error
        return self.value


# -- the fixture -------------------------------------------------------------------------------------------
class Chaos:
    def __init__(self, request: pytest.FixtureRequest, runtime_dir: Path, tmp_path: Path) -> None:
        self.request = request
        self.trainers: list[subprocess.Popen[bytes]] = []
        self.runtime_dir = runtime_dir
        self.tmp_path = tmp_path
        self.queue = f"chaos-{uuid.uuid4().hex[:10]}"
        self.gate = tmp_path / "gate"
        self.gate.mkdir()
        self.redis_url: str | None = None
        self.loaders: list[MultiprocessShuffledDataloader] = []
        self.threads: list[Worker] = []
        self.before: leaks.Snapshot | None = None
        self.record: dict[str, Any] = {"nodeid": request.node.nodeid, "host": socket.gethostname(), "run": run_id()}
        self.started = time.monotonic()

    # -- set-up ---------------------------------------------------------------------------------------------
    def begin(self, scenario: str, case: str, seed: int | None, redis_url: str | None = None) -> random.Random:
        """Name the test for the report, take the leak snapshot, and return the test's seeded RNG."""
        self.redis_url = redis_url
        self.record.update(scenario=scenario, case=case, seed=seed)
        self.before = leaks.snapshot(**self.leak_args())
        return random.Random(f"{scenario}/{case}/{seed}")

    @property
    def key_pattern(self) -> str:
        return f"gigashuffle:{{{self.queue}@*"

    def leak_args(self) -> dict[str, Any]:
        return {
            "redis_client": FreshScan(self.redis_url),
            "key_pattern": self.key_pattern,
            "runtime_dir": self.runtime_dir,
            "shm_pattern": SHM_PATTERN,
        }

    def config(self, **overrides: Any) -> DataloaderConfig:
        values: dict[str, Any] = {
            "bs": 8,
            "shuffle_size": 128,
            "queue_name": self.queue,
            "num_writers": 2,
            "num_readers": 1,
            "redis_url": self.redis_url,
        }
        values.update(overrides)
        return DataloaderConfig(**values)

    def loader(self, dataset: Any, config: DataloaderConfig) -> MultiprocessShuffledDataloader:
        loader = MultiprocessShuffledDataloader(dataset, config)
        self.loaders.append(loader)
        return loader

    def keys(self, config: DataloaderConfig) -> QueueKeys:
        return QueueKeys(config.queue_name, config.node)

    def thread(self, fn: Callable[[], Any], name: str) -> Worker:
        worker = Worker(fn, name)
        self.threads.append(worker)
        worker.start()
        return worker

    def trainer(self, out: Path, *args: str) -> subprocess.Popen[bytes]:
        """Start trainer_script.py writing to ``out`` (its output goes to ``out``/log)."""
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "log", "wb") as log:  # the child keeps its copy; ours closes at once
            proc = subprocess.Popen(
                [sys.executable, str(TRAINER_SCRIPT), "--out", str(out), *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=str(TRAINER_SCRIPT.parent),
            )  # fmt: skip
        self.trainers.append(proc)
        return proc

    def open_gate(self) -> None:
        (self.gate / "open").touch()

    def waiting_at_gate(self) -> set[int]:
        return {int(p.name.removeprefix("waiting-")) for p in self.gate.glob("waiting-*")}

    # -- probes -----------------------------------------------------------------------------------------------
    process_gone = staticmethod(process_gone)
    deadline = staticmethod(deadline)

    def settled(self, loader: MultiprocessShuffledDataloader) -> bool:
        """Every child of ``loader`` is registered and serves the buffer, whose owner published the metadata."""
        cfg = loader.config
        procs = loader.processes()
        owners = [p for p, info in procs.items() if info.get("owner")]
        with redis.Redis.from_url(loader.redis_url, socket_timeout=5.0) as client:
            meta_owner = client.hget(self.keys(cfg).meta, "owner")
        return (
            len(procs) == cfg.num_writers + cfg.num_readers
            and all(info.get("attach") for info in procs.values())
            and len(owners) == 1
            and meta_owner is not None
            and owners[0] == meta_owner.decode()
        )

    def find_victim(self, loader: MultiprocessShuffledDataloader, which: str, rng: random.Random,
                    timeout_s: float = 60.0) -> tuple[str, dict[str, Any]]:  # fmt: skip
        """``(proc id, info)`` of the owner writer, a non-owner writer, or a reader, once every child serves.

        The owner is the ``processes()`` entry with ``owner: True``; it must also be the process the signed
        metadata names.
        """
        what = "every loader child to attach and the owner to publish"
        wait_until(lambda: self.settled(loader), timeout_s=timeout_s, what=what)
        procs = loader.processes()
        if which == "owner":
            candidates = [p for p, info in procs.items() if info.get("owner")]
        elif which == "writer":
            candidates = [p for p, info in procs.items() if info["role"] == "writer" and not info.get("owner")]
        else:
            candidates = [p for p, info in procs.items() if info["role"] == which]
        assert candidates, f"no {which} among {procs}"
        proc = rng.choice(sorted(candidates))
        return proc, procs[proc]

    def registered(self, url: str, keys: QueueKeys, proc: str) -> bool:
        with redis.Redis.from_url(url, socket_timeout=5.0) as client:
            return bool(client.hexists(keys.procs, proc))

    def full_slots(self, url: str, keys: QueueKeys) -> int:
        with redis.Redis.from_url(url, socket_timeout=5.0) as client:
            size = int(client.hget(keys.meta, "slots") or 0)  # 0: no buffer published yet
        if not size:
            return 0
        with node_table(url, keys, size) as table:
            return 0 if table is None else snapshot(table).full

    def consumer(self, loader: MultiprocessShuffledDataloader) -> Consumer:
        return Consumer(loader)

    def assert_stats(self, loader: MultiprocessShuffledDataloader, timeout_s: float = 20.0) -> dict[str, Any]:
        """stats() agrees with the slot audit: the audit checks the header's counts against every slot's state and
        an empty journal in one hold of the lock, and stats() (the header's counts) must equal the states' counts.
        The loader's children may still move slots, so stats() is read before and after the audit until the two
        readings agree (the node was still over the audit)."""
        cfg = loader.config
        deadline = time.monotonic() + timeout_s
        while True:
            stats = loader.stats()
            assert min(stats.full, stats.empty, stats.in_flight) >= 0, stats
            assert stats.full + stats.empty + stats.in_flight == cfg.shuffle_size, stats
            audit = audit_slots(loader.redis_url, self.keys(cfg), cfg.shuffle_size)
            after = loader.stats()
            counted = (audit["full"], audit["empty"], audit["leased"])
            if stats == after and (stats.full, stats.empty, stats.in_flight) == counted:
                return {"stats": [stats.full, stats.empty, stats.in_flight], "audit": audit}
            assert time.monotonic() < deadline, (
                f"stats() {stats} then {after} never matched the slot audit {audit} (no quiet moment in "
                f"{timeout_s}s, or the header's counts drifted from the states)"
            )
            time.sleep(0.05)

    # -- tear-down --------------------------------------------------------------------------------------------
    def close_all(self) -> None:
        for loader in self.loaders:
            loader.close()

    def check_leaks(self, deadline_s: float = 10.0) -> None:
        assert self.before is not None, "chaos.begin() was not called"
        try:
            leaks.assert_no_leaks(self.before, deadline_s, **self.leak_args())
        except AssertionError:
            found = leaks.diff(self.before, leaks.snapshot(**self.leak_args()))
            self.record["leaks"] = {name: len(found.get(name, [])) for name in LEAK_FIELDS}
            raise
        self.record["leaks"] = dict.fromkeys(LEAK_FIELDS, 0)

    def finish(self, outcome: str, detect_s: float | None = None, **fields: Any) -> None:
        """Close every loader, assert no leaks, and record the outcome (``recovered`` or ``error: <Type>``)."""
        self.record.update(outcome=outcome, detect_s=None if detect_s is None else round(detect_s, 3), **fields)
        self.close_all()
        for worker in self.threads:
            worker.result(30.0)
        self.check_leaks()
        took = f" after {detect_s:.2f} s" if detect_s is not None else ""
        print(f"[chaos] {self.record.get('scenario')} / {self.record.get('case')} seed={self.record.get('seed')}: "
              f"{outcome}{took}; leaks {self.record['leaks']}")  # fmt: skip

    def teardown(self) -> None:
        self.open_gate()  # release stalled writers before closing, so nothing waits on the gate
        for proc in self.trainers:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        for loader in self.loaders:
            with contextlib.suppress(Exception):
                loader.close()
        for worker in self.threads:
            worker.join(10.0)
        rep = getattr(self.request.node, "rep_call", None)
        self.record["passed"] = bool(rep is not None and rep.passed)
        self.record["xfail"] = bool(rep is not None and hasattr(rep, "wasxfail"))
        self.record["wall_s"] = round(time.monotonic() - self.started, 2)
        if "scenario" in self.record:
            line = json.dumps(self.record, sort_keys=True) + "\n"
            path = report_path()
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())  # one small O_APPEND write: xdist workers never interleave
                finally:
                    os.close(fd)


@pytest.fixture
def chaos(
    request: pytest.FixtureRequest, runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Chaos]:
    monkeypatch.delenv("GIGASHUFFLE_REDIS_URL", raising=False)  # no Redis unless a test names one
    harness = Chaos(request, runtime_dir, tmp_path)
    try:
        yield harness
    finally:
        harness.teardown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


# -- the report --------------------------------------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: failure injection")
    if not hasattr(config, "workerinput"):
        run_id()  # the controller names the run before xdist starts its workers, which inherit the name


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return
    path = report_path()
    with contextlib.suppress(OSError):
        if path.exists() and path.stat().st_size:
            path.with_suffix(".md").write_text(markdown_report(path, run_id()))


def _span(values: list[float]) -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    return f"{low:.2f} s" if abs(high - low) < 0.005 else f"{low:.2f}-{high:.2f} s"


def markdown_report(path: Path, run: str | None = None) -> str:
    """The records of run ``run`` in ``path`` (or of every run; the last one per test) as a table."""
    records: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if run is None or rec.get("run") == run:
                records[rec["nodeid"]] = rec
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rec in records.values():
        groups.setdefault((rec["scenario"], rec["case"]), []).append(rec)
    lines = [
        "| scenario | case | seeds | outcome | leak figures (shm, sem, fds, procs, sockets, keys, memfd maps) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (scenario, case), recs in sorted(groups.items()):
        seeds = ", ".join(str(r["seed"]) for r in sorted(recs, key=lambda r: str(r["seed"])))
        outcomes: dict[str, list[Any]] = {}
        for r in recs:
            label = r.get("outcome") or "did not finish"
            if r.get("xfail"):
                label = f"xfail ({label})"
            elif not r.get("passed"):
                label = f"FAILED ({label})"
            entry = outcomes.setdefault(label, [0, []])
            entry[0] += 1
            if r.get("detect_s") is not None:
                entry[1].append(float(r["detect_s"]))
        text = "; ".join(
            f"{label}{' after ' + _span(times) if times else ''} (x{count})"
            for label, (count, times) in outcomes.items()
        )
        figures = [r.get("leaks") or {} for r in recs]
        if all(figures):
            leak_text = ", ".join(str(max(f.get(k, 0) for f in figures)) for k in LEAK_FIELDS)
        else:
            leak_text = "not measured"
        lines.append(f"| {scenario} | {case} | {seeds} | {text} | {leak_text} |")
    return "\n".join(lines) + "\n"
