"""Zygote.close() says whether every child is known dead: the trainer names a child's pid to the slot table's
repair only then (a child still dying could otherwise commit slots just repaired; NOTE [ Node lock budget ]).

A zygote that reaped its children is parked for the process's next loader (NOTE [ Reused zygotes ] in
procs/zygotereuse.py): reused only when it started as a fresh one would now, never once dead, and never outliving
the process that parked it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from forked import fork_child, held_by_a_thread, wait_child

from gigashuffle.host.pids import pid_alive
from gigashuffle.procs import zygoteclient, zygotereuse
from gigashuffle.procs.zygoteclient import Zygote
from gigashuffle.procs.zygotereuse import parked_zygote_pid

TITLE = "gigashuffle zygote close-test"


@pytest.fixture(autouse=True)
def _no_parked_zygote() -> Iterator[None]:
    """Each test starts and ends with no zygote parked (a later test must not reuse one of this test's)."""
    zygotereuse.PARKING.end_parked()
    yield
    zygotereuse.PARKING.end_parked()


def _gone(pid: int, deadline_s: float = 10.0) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


def test_a_zygote_that_released_its_children_is_parked_and_taken_by_the_next_loader() -> None:
    zygote = Zygote(TITLE)
    assert zygote.reused is False
    assert zygote.close() is True
    assert pid_alive(zygote.pid) and parked_zygote_pid() == zygote.pid
    assert zygote.close() is False  # closed already: it vouches for nothing now, and leaves the parked one alone
    assert parked_zygote_pid() == zygote.pid
    again = Zygote(TITLE)
    assert again.reused is True and again.pid == zygote.pid
    assert parked_zygote_pid() is None
    assert again.events() == []  # its Prepared was taken by the reuse, not left for the supervisor
    assert again.close() is True


def test_a_zygote_started_with_another_start_up_environment_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    first = Zygote(TITLE)
    assert first.close() is True
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read when torch starts: a fresh zygote would read 3
    second = Zygote(TITLE)
    assert second.reused is False and second.pid != first.pid
    assert _gone(first.pid), "the parked zygote that could not be reused was left running"
    assert second.close() is True


def test_a_second_released_zygote_ends_instead_of_being_parked() -> None:
    one, two = Zygote(TITLE), Zygote(TITLE)
    assert one.close() is True and two.close() is True
    assert parked_zygote_pid() == one.pid
    assert _gone(two.pid)


def test_a_parked_zygote_that_died_is_never_handed_to_a_loader() -> None:
    zygote = Zygote(TITLE)
    assert zygote.close() is True
    os.kill(zygote.pid, signal.SIGKILL)
    assert _gone(zygote.pid)
    fresh = Zygote(TITLE)
    assert fresh.reused is False and fresh.pid != zygote.pid
    assert fresh.close() is True


def test_a_zygote_that_must_be_killed_is_not_vouched_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygoteclient, "_ZYGOTE_EXIT_TIMEOUT_S", 0.5)
    zygote = Zygote(TITLE)
    os.kill(zygote.pid, signal.SIGSTOP)  # it cannot answer Release or see its channel close: it never reaps
    assert zygote.close() is False
    assert not pid_alive(zygote.pid)
    assert parked_zygote_pid() is None


def test_an_ending_zygote_does_not_make_a_removed_runtime_directory_again(runtime_dir: Path) -> None:
    """Its last act removes sockets its trainer and children left in the runtime directory. That cleanup made the
    directory again when it was gone (every test's own directory, removed at its teardown, came back empty once the
    process's parked zygote ended: dozens per suite run, left in /tmp)."""
    zygote = Zygote(TITLE)
    assert zygote.close() is True and parked_zygote_pid() == zygote.pid
    shutil.rmtree(runtime_dir)
    zygotereuse.PARKING.end_parked()
    assert _gone(zygote.pid)
    assert not runtime_dir.exists(), "the zygote's cleanup made the runtime directory again"


def test_a_forked_copy_of_the_trainer_neither_releases_nor_ends_the_zygote() -> None:
    """A fork of the trainer that closes its copy of a loader (at its exit) must leave the trainer's zygote alone:
    a ``Release`` from it would kill the trainer's children and park the zygote under the trainer's feet."""
    zygote = Zygote(TITLE)
    child = fork_child(lambda: 0 if zygote.close() is False else 1)
    status = wait_child(child)
    assert os.waitstatus_to_exitcode(status) == 0, "close() in the fork did something"
    assert zygote.events() == []  # no Released (nor anything else) came back
    assert zygote.close() is True and parked_zygote_pid() == zygote.pid


def test_a_fork_made_while_another_thread_held_the_parking_lock_can_take_a_zygote() -> None:
    """A trainer thread inside the parking's lock while the main thread forks (a DataLoader worker starting): the
    fork's copy of the lock would be held forever, and its first loader would hang taking a zygote."""
    with held_by_a_thread(lambda: zygotereuse.PARKING._lock):
        child = fork_child(lambda: 0 if zygotereuse.PARKING.take(("no such start",), {}) is None else 1)
        status = wait_child(child, 20)  # a fork that waits on the lock fails here, at the deadline
    assert os.waitstatus_to_exitcode(status) == 0


_PARKS_AND_WAITS = """
import sys, time
from gigashuffle.procs.zygoteclient import Zygote
zygote = Zygote("gigashuffle zygote exit-test")
assert zygote.close() is True
print(zygote.pid, flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_a_parked_zygote_does_not_outlive_its_process(end: str) -> None:
    """At a normal exit the process ends its parked zygote and waits for it; SIGKILLed, the zygote sees its channel
    close and exits."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", _PARKS_AND_WAITS, "wait" if end == "sigkill" else "exit"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert trainer.stdout is not None
        pid = int(trainer.stdout.readline())
        if end == "sigkill":
            trainer.kill()
        assert trainer.wait(60) == (-signal.SIGKILL if end == "sigkill" else 0)
        if end == "exit":
            assert not pid_alive(pid), "the process exited and left its parked zygote running"
        assert _gone(pid), f"the parked zygote {pid} outlived its trainer"
    finally:
        trainer.kill()
        trainer.wait()


_FORKS_AND_ENDS = """
import os, sys, time
from gigashuffle.procs.zygoteclient import Zygote
zygote = Zygote("gigashuffle zygote fork-test")
if sys.argv[2] == "parked":
    assert zygote.close() is True
fork = os.fork()
if fork == 0:  # a DataLoader worker, say: it holds whatever the trainer's fork left it (but the test's pipes)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(600)
    os._exit(0)
print(zygote.pid, fork, flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


@pytest.mark.parametrize("zygote", ["parked", "serving"])
@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_a_zygote_does_not_outlive_its_trainer_while_a_fork_of_the_trainer_lives(end: str, zygote: str) -> None:
    """A zygote learns of its trainer's end by its channel's EOF; a fork of the trainer (a DataLoader worker) that
    kept a copy of the channel would hold that EOF back (NOTE [ Reused zygotes ]): at an exit the trainer waited
    for its parked zygote in vain, killed it and warned; SIGKILLed, the zygote lived as long as the fork."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", _FORKS_AND_ENDS, "wait" if end == "sigkill" else "exit", zygote],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    fork = 0
    try:
        assert trainer.stdout is not None and trainer.stderr is not None
        pid, fork = (int(word) for word in trainer.stdout.readline().split())
        if end == "sigkill":
            trainer.kill()
        assert trainer.wait(60) == (-signal.SIGKILL if end == "sigkill" else 0)
        assert pid_alive(fork), "the fork is the point of this test: it must still live"
        assert _gone(pid), f"the zygote {pid} outlived its trainer while the trainer's fork {fork} lived"
        assert "did not exit" not in trainer.stderr.read(), "the trainer had to kill its zygote"
    finally:
        trainer.kill()
        trainer.wait()
        if fork:
            os.kill(fork, signal.SIGKILL)
