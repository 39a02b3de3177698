"""FillProgress with a fake clock and probe: what the lines say, when a bar is drawn, and that without tqdm there are
still lines; StalledWriters: which late writers a trainer warns of; EmptyNode: when a node can have no row."""

from __future__ import annotations

import importlib
import io
import logging
import re
from types import ModuleType

import pytest

from gigashuffle import DataloaderConfig, SchemaError
from gigashuffle.trainer import progress, waiting
from gigashuffle.trainer.progress import FillProgress, format_eta
from gigashuffle.trainer.waiting import EmptyNode, StalledWriters

LINE = re.compile(
    r"^queue 'q' rank 0: filling the shuffle buffer: (?P<rows>[\d,]+)/(?P<total>[\d,]+) rows \((?P<pct>[\d.]+)%\), "
    r"(?P<rate>[\d,]+) rows/s, ETA (?P<eta>.+)$"
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "gigashuffle.trainer.progress" and r.levelno == logging.INFO
    ]


def test_a_line_every_interval_with_rows_rate_and_eta(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "FIRST_LINE_S", 5.0)  # the first line's own time: the next test
    caplog.set_level(logging.INFO, logger="gigashuffle.trainer.progress")
    clock, rows = Clock(), [0]
    fill = FillProgress("queue 'q' rank 0", 2000, lambda: rows[0], interval_s=5.0, clock=clock, stream=io.StringIO())
    fill.update()  # the first probe: the rate's origin
    for _ in range(9):  # 4.5 s at 100 rows/s: no line yet
        clock.now += 0.5
        rows[0] += 50
        fill.update()
    assert _lines(caplog) == []
    clock.now += 0.5
    rows[0] += 50
    fill.update()
    (line,) = _lines(caplog)
    match = LINE.match(line)
    assert match, line
    assert match["rows"] == "500" and match["total"] == "2,000" and match["pct"] == "25.0"
    assert match["rate"] == "100" and match["eta"] == "15 s"  # 1,500 rows left at 100 rows/s
    rows[0] = 2000
    clock.now += 1.0
    fill.update()  # the target: one closing line, then silence
    clock.now += 10.0
    fill.update()
    lines = _lines(caplog)
    assert len(lines) == 2 and "reached 2,000 full rows (min_mixing) after 6.0 s" in lines[1], lines


def test_no_rows_yet_gives_an_unknown_eta_and_a_fast_fill_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gigashuffle.trainer.progress")
    clock = Clock()
    fill = FillProgress("queue 'q' rank 0", 64, lambda: 0, interval_s=1.0, clock=clock, stream=io.StringIO())
    fill.update()
    clock.now += 1.0
    fill.update()
    assert _lines(caplog) == ["queue 'q' rank 0: filling the shuffle buffer: 0/64 rows (0.0%), 0 rows/s, "
                              "ETA unknown (no rows yet)"]  # fmt: skip
    caplog.clear()
    quick = FillProgress("queue 'q' rank 0", 64, lambda: 64, interval_s=1.0, clock=clock, stream=io.StringIO())
    quick.update()
    quick.finish()
    assert _lines(caplog) == [], "a buffer that filled before the first line was due is not reported"


def test_a_fill_the_probes_did_not_see_reports_the_rows_it_reached_at_their_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first batch comes while the last probe saw no row (the rows came between two probes): the closing line
    counts the rows it says were reached, not '0 rows/s'."""
    caplog.set_level(logging.INFO, logger="gigashuffle.trainer.progress")
    clock = Clock()
    fill = FillProgress("queue 'q' rank 0", 64, lambda: 0, interval_s=1.0, clock=clock, stream=io.StringIO())
    fill.update()
    clock.now += 1.0
    fill.update()  # a line: 0/64 rows; the rate counts from here, the last probe without a row
    clock.now += 0.25
    fill.finish()  # the first batch
    assert _lines(caplog)[-1] == (
        "queue 'q' rank 0: the shuffle buffer reached 64 full rows (min_mixing) after 1.2 s (256 rows/s)"
    ), _lines(caplog)


def test_closing_before_the_target_does_not_claim_it_was_reached(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gigashuffle.trainer.progress")
    clock = Clock()
    fill = FillProgress("queue 'q' rank 0", 64, lambda: 3, interval_s=1.0, clock=clock, stream=io.StringIO())
    fill.update()
    clock.now += 1.0
    fill.update()
    fill.finish(reached=False)
    assert len(_lines(caplog)) == 1 and "reached" not in _lines(caplog)[0]


def test_a_bar_only_on_a_terminal() -> None:
    pytest.importorskip("tqdm")
    rows = [0]
    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        fill = FillProgress("queue 'q' rank 0", 1000, lambda: rows[0], interval_s=60.0, stream=stream)
        rows[0] = 250
        fill.update()
        fill.finish()
    assert "gigashuffle queue 'q' rank 0: filling" in tty.getvalue() and "250/1000" in tty.getvalue()
    assert pipe.getvalue() == ""
    rows[0] = 0
    assert FillProgress("q", 10, lambda: 0, bar=False, stream=Tty())._bar is None, "bar=False: lines only"


def test_without_tqdm_there_are_only_lines(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gigashuffle.trainer.progress")
    real = importlib.import_module

    def no_tqdm(name: str, package: str | None = None) -> ModuleType:
        if name == "tqdm":
            raise ImportError("No module named 'tqdm'")
        return real(name, package)

    monkeypatch.setattr(progress.importlib, "import_module", no_tqdm)
    clock = Clock()
    tty = Tty()
    fill = FillProgress("queue 'q' rank 0", 10, lambda: 1, interval_s=1.0, clock=clock, stream=tty)
    fill.update()
    clock.now += 1.0
    fill.update()
    assert tty.getvalue() == "" and len(_lines(caplog)) == 1


def test_the_interval_comes_from_the_module_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.25)
    assert FillProgress("q", 10, lambda: 0, stream=io.StringIO()).interval_s == 0.25


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "< 1 s"), (1, "1 s"), (59, "59 s"), (125, "2 min 5 s"), (7380, "2 h 3 min")]
)
def test_eta_format(seconds: float, text: str) -> None:
    assert format_eta(seconds) == text


def test_the_first_line_comes_a_second_into_the_wait_and_reaches_stderr_without_logging_configured(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, item 4: a wait of a second shows the rows in and the rows the first batch needs; with no logging
    configured (Python would drop an INFO line) and no bar, the line goes to stderr itself."""
    caplog.set_level(logging.INFO, logger="gigashuffle.trainer.progress")
    clock, stream = Clock(), io.StringIO()
    fill = FillProgress("queue 'q' rank 0", 2000, lambda: 300, interval_s=5.0, clock=clock, stream=stream)
    fill.update()
    clock.now += progress.FIRST_LINE_S
    fill.update()
    (line,) = _lines(caplog)
    assert "300/2,000 rows" in line, line
    assert stream.getvalue() == "", "a handler shows it (caplog's): nothing on stderr twice"
    monkeypatch.setattr(progress.log, "hasHandlers", lambda: False)
    clock.now += 5.0
    fill.update()
    assert stream.getvalue().startswith("gigashuffle: queue 'q' rank 0: filling the shuffle buffer: 300/2,000 rows")


def test_only_writers_that_wrote_no_row_for_stall_s_are_stalled_each_once() -> None:
    """Issue 35, item 4: a writer short of its first-mix share that keeps writing is slow, not stalled, however long
    the wait; one whose rows stop moving (or that never wrote, ``None``: no counters page yet) is, once."""
    clock = Clock()
    stalls = StalledWriters(10.0, clock=clock)
    rows: dict[int, int | None] = {0: None, 1: 0, 2: 0}
    for second in range(1, 30):  # writer 0 writes from second 3 on, writer 1 all along, writer 2 stops at second 4
        clock.now += 1.0
        rows = {0: None if second < 3 else 4 * second, 1: 4 * second, 2: 4 * min(second, 4)}
        stalled = stalls.check(rows)
        if second == 14:  # writer 2's rows last moved at second 4
            assert stalled == [2], (second, stalled)
        else:
            assert stalled == [], (second, stalled)
    late = StalledWriters(10.0, clock=clock)
    clock.now += 100.0  # built long before its first wait (a loader made, then iterated later): that time is no stall
    assert late.check({5: None}) == [], "the clock starts at the first wait"
    clock.now += 9.9
    assert late.check({5: None}) == []
    clock.now += 0.1
    assert late.check({5: None}) == [5], "no row since the wait began: stalled"
    clock.now += 100.0
    assert late.check({5: None}) == [], "warned once"


def test_an_empty_node_fails_only_once_every_writer_idled_empty_unpublished_for_empty_node_s() -> None:
    """NOTE [ Empty shares ]: 2 ranks x 2 writers. Three idle writers, a published buffer, or all four for less than
    EMPTY_NODE_S are waits that may still end in rows; four idle for EMPTY_NODE_S with nothing published are not."""
    clock = Clock()
    cfg = DataloaderConfig(
        bs=4, shuffle_size=64, num_writers=2, local_world_size=2, global_world_size=2, queue_name="q"
    )
    node = EmptyNode(cfg, clock=clock)
    node.check(False, 3)
    clock.now += 100.0
    node.check(False, 3)  # a writer of the node still has rows to come (or has not started)
    node.check(False, 4)  # the clock starts here
    clock.now += waiting.EMPTY_NODE_S - 0.1
    node.check(False, 4)
    node.check(False, 3)  # a writer left the idle set (a state or a context given to it): the clock starts again
    node.check(False, 4)
    clock.now += waiting.EMPTY_NODE_S - 0.1
    node.check(False, 4)
    node.check(True, 4)  # a buffer was published: some writer of the node has rows
    clock.now += waiting.EMPTY_NODE_S
    node.check(True, 4)
    node.check(False, 4)
    clock.now += waiting.EMPTY_NODE_S
    with pytest.raises(SchemaError, match=r"every writer of node 'n0' \(4: num_writers=2 x local_world_size=2\)"):
        node.check(False, 4)
