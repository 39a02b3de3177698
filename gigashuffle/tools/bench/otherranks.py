"""The bench's side of ``gigashuffle bench --ranks R``: ranks 1..R-1 of its node, each a process of its own that
runs :mod:`.ranks`, started together, timed over the window of rank 0 and stopped together.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from gigashuffle.tools.bench.rankchannel import LineChannel, PeerGone
from gigashuffle.tools.bench.ranks import READY_TIMEOUT_S
from gigashuffle.tools.bench.workloads import Workload

log = logging.getLogger(__name__)

# After the window ends a rank finishes the batch it is on: one batch, even a slow one, is far below this.
REPORT_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 60.0
# On an error the ranks are told to stop, given this long, then sent SIGTERM, then SIGKILL.
ABORT_GRACE_S = 5.0
KILL_GRACE_S = 30.0

Pids = dict[str, list[int]]


class RankProcess:
    """Rank ``rank`` (>= 1) of the bench's node, running :mod:`.ranks` in its own process."""

    def __init__(self, rank: int, args: Sequence[str]) -> None:
        self.rank = rank
        # stdout carries the reports; stderr is the bench's, so a rank's logs and tracebacks show up as they happen.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gigashuffle.tools.bench.ranks", "--rank", str(rank), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        if self.proc.stdin is None or self.proc.stdout is None:
            raise AssertionError("Popen with PIPE gave no stdin/stdout")
        self.channel = LineChannel(
            self.proc.stdout.fileno(), self.proc.stdin.fileno(), f"bench rank {rank}", lambda: self.proc.poll() is None
        )

    def stop(self, clean: bool) -> None:
        """Tell the rank to close its loader and exit; escalate to SIGTERM then SIGKILL if it does not in time."""
        proc = self.proc
        if proc.stdin is None or proc.stdout is None:
            raise AssertionError("Popen with PIPE gave no stdin/stdout")
        if clean and not proc.stdin.closed and proc.poll() is None:
            with contextlib.suppress(PeerGone):
                self.channel.send({"close": True})
        if not proc.stdin.closed:
            proc.stdin.close()  # end of file: a rank that is not reading now sees it at its next receive
        try:
            proc.wait(CLOSE_TIMEOUT_S if clean else ABORT_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("bench rank %d did not exit; sending SIGTERM", self.rank)
            proc.terminate()
            try:
                proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("bench rank %d ignored SIGTERM; killing it", self.rank)
                proc.kill()
                proc.wait(KILL_GRACE_S)
        proc.stdout.close()
        if clean and proc.returncode != 0:
            log.error("bench rank %d exited with status %d", self.rank, proc.returncode)


@dataclass
class RankReport:
    """What a rank process reported: its pids, its warm-up and (after the window) its rate."""

    rank: int
    pids: Pids
    warmup: dict[str, Any]
    rate: dict[str, Any] | None = None


class OtherRanks:
    """Ranks 1..R-1 of the node: started together, timed over the window of rank 0, stopped together.

    A context manager: on leaving it every rank process is stopped, on an error without waiting for a clean close.
    """

    def __init__(
        self,
        workload: Workload,
        queue_name: str,
        writers: int,
        readers: int,
        ranks: int,
        redis_url: str,
    ) -> None:
        args = ["--workload", workload.name, "--queue", queue_name, "--writers", str(writers)]
        args += ["--readers", str(readers), "--ranks", str(ranks), "--redis-url", redis_url]
        self.processes: list[RankProcess] = []
        try:
            for rank in range(1, ranks):
                self.processes.append(RankProcess(rank, args))
        except BaseException:
            self._stop_all(clean=False)
            raise
        self.reports: list[RankReport] = []

    def __enter__(self) -> OtherRanks:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop_all(clean=exc_type is None)

    def _stop_all(self, clean: bool) -> None:
        if not clean:
            # Closing every stdin first lets all ranks wind down at once rather than one after the other.
            for process in self.processes:
                if process.proc.stdin is not None and not process.proc.stdin.closed:
                    process.proc.stdin.close()
        for process in self.processes:
            process.stop(clean)

    def wait_ready(self) -> list[RankReport]:
        """Block until every rank has warmed up; their pids (trainer and children) by role."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        self.reports = []
        for process in self.processes:
            message = process.channel.receive(deadline, "ready report")
            self.reports.append(RankReport(process.rank, message["pids"], message["warmup"]))
        return self.reports

    def start_window(self, end: float) -> None:
        for process in self.processes:
            process.channel.send({"end": end})

    def collect_rates(self, end: float) -> list[RankReport]:
        deadline = end + REPORT_TIMEOUT_S
        for process, report in zip(self.processes, self.reports, strict=True):
            report.rate = process.channel.receive(deadline, "rate report")["rate"]
        return self.reports
