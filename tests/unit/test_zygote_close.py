"""Zygote.close() says whether every child is known dead: the trainer names a child's pid to the slot table's
repair only then (a child still dying could otherwise commit slots just repaired; NOTE [ Node lock budget ])."""

from __future__ import annotations

import os
import signal

import pytest

from gigashuffle.host.pids import pid_alive
from gigashuffle.procs import zygoteclient
from gigashuffle.procs.zygoteclient import Zygote


def test_a_zygote_that_exits_on_its_own_has_reaped_its_children() -> None:
    zygote = Zygote("gigashuffle zygote close-test")
    assert zygote.close() is True
    assert not pid_alive(zygote.pid)
    assert zygote.close() is False  # gone already: nothing known of its children now


def test_a_zygote_that_must_be_killed_is_not_vouched_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygoteclient, "_ZYGOTE_EXIT_TIMEOUT_S", 0.5)
    zygote = Zygote("gigashuffle zygote close-test")
    os.kill(zygote.pid, signal.SIGSTOP)  # it cannot see its channel close, so it never reaps or exits
    assert zygote.close() is False
    assert not pid_alive(zygote.pid)
